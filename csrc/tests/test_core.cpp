// Pure C++ checks of the native core, without Python: recall against brute force, persistence round trip, and
// rejection of a corrupted file. Built with -DCERTRAG_BUILD_TESTS=ON; tests/test_native_cpp.py builds and runs it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "certrag/hnsw.h"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::cerr << "FAILED: " << what << "\n";
  }
}

std::vector<float> random_unit_rows(std::size_t n, std::size_t dim, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  // A few clusters, so that the graph has structure to find.
  std::vector<float> centres(16 * dim);
  for (float& c : centres) c = normal(rng);
  std::vector<float> out(n * dim);
  for (std::size_t i = 0; i < n; ++i) {
    const float* c = centres.data() + (i % 16) * dim;
    double norm = 0;
    for (std::size_t j = 0; j < dim; ++j) {
      out[i * dim + j] = c[j] + 0.5f * normal(rng);
      norm += out[i * dim + j] * out[i * dim + j];
    }
    for (std::size_t j = 0; j < dim; ++j) out[i * dim + j] /= static_cast<float>(std::sqrt(norm));
  }
  return out;
}

double recall(const certrag::HnswIndex& index, const std::vector<float>& base, const std::vector<float>& queries,
              std::size_t dim, std::size_t k) {
  const std::size_t n = base.size() / dim, nq = queries.size() / dim;
  std::vector<std::int64_t> ids(nq * k);
  std::vector<float> scores(nq * k);
  index.search(nq, queries.data(), k, 200, 0, ids.data(), scores.data());
  std::size_t hits = 0;
  for (std::size_t q = 0; q < nq; ++q) {
    std::vector<std::pair<float, std::int64_t>> all(n);
    for (std::size_t i = 0; i < n; ++i) {
      float dot = 0;
      for (std::size_t j = 0; j < dim; ++j) dot += queries[q * dim + j] * base[i * dim + j];
      all[i] = {-dot, static_cast<std::int64_t>(i)};
    }
    std::partial_sort(all.begin(), all.begin() + static_cast<long>(k), all.end());
    std::set<std::int64_t> truth;
    for (std::size_t i = 0; i < k; ++i) truth.insert(all[i].second);
    for (std::size_t i = 0; i < k; ++i) hits += truth.count(ids[q * k + i]);
  }
  return static_cast<double>(hits) / static_cast<double>(nq * k);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : ".";
  const std::size_t n = 2000, nq = 50, dim = 24, k = 10;
  const auto base = random_unit_rows(n, dim, 1);
  const auto queries = random_unit_rows(nq, dim, 2);

  certrag::HnswConfig config;
  config.dim = dim;
  config.M = 8;
  config.ef_construction = 64;
  check(config.validate().empty(), "valid config");
  certrag::HnswConfig bad = config;
  bad.M = 1;
  check(bad.validate() == "M must be at least 2", "M validation message");

  certrag::HnswIndex index(config);
  std::vector<std::int64_t> labels(n);
  for (std::size_t i = 0; i < n; ++i) labels[i] = static_cast<std::int64_t>(i);
  index.add(n, base.data(), labels.data(), 0);
  check(index.size() == n, "size after add");
  const double r = recall(index, base, queries, dim, k);
  check(r >= 0.95, "recall@10 >= 0.95, got " + std::to_string(r));

  bool threw = false;
  try {
    index.add(1, base.data(), labels.data(), 0);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  check(threw && index.size() == n, "duplicate label refused, nothing added");

  const std::string path = dir + "/core_test.hnsw";
  index.save(path);
  auto loaded = certrag::HnswIndex::load(path, false);
  check(std::abs(recall(*loaded, base, queries, dim, k) - r) < 1e-12, "same recall after load");

  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(300);
    char byte = 0;
    f.read(&byte, 1);
    byte ^= 0x10;
    f.seekp(300);
    f.write(&byte, 1);
  }
  threw = false;
  try {
    certrag::HnswIndex::load(path, true);
  } catch (const certrag::IndexFormatError&) {
    threw = true;
  }
  check(threw, "corrupted file raises IndexFormatError");
  std::remove(path.c_str());

  if (failures == 0) std::cout << "certrag core tests: all passed (recall " << r << ")\n";
  return failures == 0 ? 0 : 1;
}
