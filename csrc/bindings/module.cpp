// The one pybind11 file: check shapes and dtypes once, allocate outputs, release the GIL around the work, and turn
// C++ errors into Python exceptions (std::invalid_argument -> ValueError, IndexFormatError -> certrag's
// IndexFormatError, a ValueError subclass). No algorithm lives here.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sstream>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>

#include "certrag/checksum.h"
#include "certrag/distance.h"
#include "certrag/hnsw.h"
#include "certrag/pair_scorer.h"
#include "certrag/q8.h"
#include "certrag/q8_packed.h"
#include "certrag/decode_attention.h"

namespace py = pybind11;
using certrag::HnswIndex;

namespace {

using FloatArray = py::array_t<float, py::array::c_style>;
using LabelArray = py::array_t<std::int64_t, py::array::c_style>;

std::string shape_text(const py::array& a) {
  std::ostringstream s;
  s << "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s << (i ? ", " : "") << a.shape(i);
  s << (a.ndim() == 1 ? ",)" : ")");
  return s.str();
}

// Requires a C-contiguous float32 array of shape (n, dim); returns n.
std::size_t check_matrix(const py::array& a, const char* name, std::size_t dim) {
  if (!py::isinstance<FloatArray>(a) || !(a.flags() & py::array::c_style) || a.ndim() != 2 ||
      static_cast<std::size_t>(a.shape(1)) != dim) {
    std::ostringstream s;
    s << name << " must be a C-contiguous float32 array of shape (n, " << dim << "); got " << py::str(a.dtype()).cast<std::string>()
      << " of shape " << shape_text(a);
    throw py::value_error(s.str());
  }
  return static_cast<std::size_t>(a.shape(0));
}

std::size_t check_labels(const py::array& a, const char* name, std::size_t n) {
  if (!py::isinstance<LabelArray>(a) || !(a.flags() & py::array::c_style) || a.ndim() != 1 ||
      (n != static_cast<std::size_t>(-1) && static_cast<std::size_t>(a.shape(0)) != n)) {
    std::ostringstream s;
    s << name << " must be a C-contiguous int64 array of shape (" << (n == static_cast<std::size_t>(-1) ? std::string("n") : std::to_string(n))
      << ",); got " << py::str(a.dtype()).cast<std::string>() << " of shape " << shape_text(a);
    throw py::value_error(s.str());
  }
  return static_cast<std::size_t>(a.shape(0));
}

certrag::SimdLevel parse_level(const std::string& level) {
  if (level == "scalar") return certrag::SimdLevel::scalar;
  if (level == "avx2") return certrag::SimdLevel::avx2;
  if (level == "avx512") return certrag::SimdLevel::avx512;
  if (level == "auto") return certrag::distance_kernels().level;
  throw py::value_error("level must be 'auto', 'scalar', 'avx2' or 'avx512'; got '" + level + "'");
}

std::size_t check_vector(const py::array& a, const char* name, std::size_t n) {
  if (!py::isinstance<FloatArray>(a) || !(a.flags() & py::array::c_style) || a.ndim() != 1 ||
      static_cast<std::size_t>(a.shape(0)) != n) {
    std::ostringstream s;
    s << name << " must be a C-contiguous float32 array of shape (" << n << ",); got "
      << py::str(a.dtype()).cast<std::string>() << " of shape " << shape_text(a);
    throw py::value_error(s.str());
  }
  return n;
}

certrag::Metric parse_metric(const std::string& name) {
  if (name == "ip") return certrag::Metric::ip;
  if (name == "l2") return certrag::Metric::l2;
  if (name == "cosine") return certrag::Metric::cosine;
  throw py::value_error("metric must be 'ip', 'l2' or 'cosine'; got '" + name + "'");
}

using Int8Array = py::array_t<std::int8_t, py::array::c_style>;
using Int64Ids = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>;

// Requires a C-contiguous int8 array of shape (n, k); returns (n, k).
std::pair<std::size_t, std::size_t> check_int8_matrix(const py::array& a, const char* name) {
  if (!py::isinstance<Int8Array>(a) || !(a.flags() & py::array::c_style) || a.ndim() != 2) {
    std::ostringstream s;
    s << name << " must be a C-contiguous int8 array of shape (n, k); got " << py::str(a.dtype()).cast<std::string>()
      << " of shape " << shape_text(a);
    throw py::value_error(s.str());
  }
  return {static_cast<std::size_t>(a.shape(0)), static_cast<std::size_t>(a.shape(1))};
}

void check_q8_weights(const py::array& q, const py::array& scales, std::size_t& n, std::size_t& k) {
  std::tie(n, k) = check_int8_matrix(q, "q");
  if (k == 0 || k % certrag::kQ8Group != 0)
    throw py::value_error("q's columns must be a positive multiple of " + std::to_string(certrag::kQ8Group) +
                          "; got shape " + shape_text(q));
  if (check_matrix(scales, "scales", k / certrag::kQ8Group) != n)
    throw py::value_error("scales must have shape (" + std::to_string(n) + ", " +
                          std::to_string(k / certrag::kQ8Group) + "); got " + shape_text(scales));
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "certrag's native core: HNSW index and distance kernels";

  py::register_exception<certrag::IndexFormatError>(m, "IndexFormatError", PyExc_ValueError);
  py::register_exception<certrag::IndexIoError>(m, "IndexIOError", PyExc_OSError);

  m.def(
      "checksum64",
      [](const py::bytes& data) {
        const std::string_view view(data);
        return certrag::checksum64(view.data(), view.size());
      },
      py::arg("data"),
      "The index file's checksum of a byte string (for tools and tests that build or repair files).");

  m.def("build_info", []() {
    py::dict info;
#if defined(__clang__)
    info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
    info["compiler"] = std::string("gcc ") + __VERSION__;
#else
    info["compiler"] = "unknown";
#endif
    info["cxx_standard"] = static_cast<long>(__cplusplus);
    info["simd_compiled"] = certrag::simd_levels_compiled();
    info["simd_active"] = certrag::simd_level_name(certrag::distance_kernels().level);
    info["bfloat16_pair_scorer"] = certrag::cpu_supports_bf16();
    info["q8_kernel"] = certrag::q8_path_name(certrag::q8_packed_path());
    info["threads"] = "std::thread";
    info["hardware_concurrency"] = std::thread::hardware_concurrency();
#ifdef NDEBUG
    info["build_type"] = "release";
#else
    info["build_type"] = "debug";
#endif
    info["index_format_version"] = HnswIndex::kFormatVersion;
    return info;
  });

  m.def(
      "distance",
      [](const py::array& a, const py::array& b, const std::string& kind, const std::string& level) {
        const std::size_t dim = a.ndim() == 2 ? static_cast<std::size_t>(a.shape(1)) : 0;
        const std::size_t n = check_matrix(a, "a", dim);
        if (check_matrix(b, "b", dim) != n) throw py::value_error("a and b must have the same shape");
        certrag::SimdLevel lv = certrag::SimdLevel::scalar;
        if (level == "avx2") lv = certrag::SimdLevel::avx2;
        else if (level == "avx512") lv = certrag::SimdLevel::avx512;
        else if (level != "scalar") throw py::value_error("level must be scalar, avx2 or avx512");
        if (!certrag::cpu_supports(lv)) throw py::value_error("this CPU does not support " + level);
        const auto k = certrag::distance_kernels_for(lv);
        if (kind != "dot" && kind != "l2sq") throw py::value_error("kind must be 'dot' or 'l2sq'");
        auto fn = kind == "dot" ? k.dot : k.l2sq;
        py::array_t<float> out(static_cast<py::ssize_t>(n));
        const float* pa = static_cast<const float*>(a.data());
        const float* pb = static_cast<const float*>(b.data());
        float* po = out.mutable_data();
        for (std::size_t i = 0; i < n; ++i) po[i] = fn(pa + i * dim, pb + i * dim, dim);
        return out;
      },
      py::arg("a"), py::arg("b"), py::arg("kind"), py::arg("level"),
      "Row-wise dot or squared L2 with the kernel of one SIMD level (for tests).");

  m.def(
      "q8_quantize",
      [](const py::array& w, int num_threads) {
        if (!py::isinstance<FloatArray>(w) || !(w.flags() & py::array::c_style) || w.ndim() != 2 ||
            w.shape(1) == 0 || w.shape(1) % static_cast<py::ssize_t>(certrag::kQ8Group) != 0)
          throw py::value_error("w must be a C-contiguous float32 array of shape (n, k) with k a positive multiple of " +
                                std::to_string(certrag::kQ8Group) + "; got " + py::str(w.dtype()).cast<std::string>() +
                                " of shape " + shape_text(w));
        const auto n = static_cast<std::size_t>(w.shape(0)), k = static_cast<std::size_t>(w.shape(1));
        Int8Array q({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(k)});
        FloatArray scales({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(k / certrag::kQ8Group)});
        const float* pw = static_cast<const float*>(w.data());
        std::int8_t* pq = q.mutable_data();
        float* ps = scales.mutable_data();
        {
          py::gil_scoped_release release;
          certrag::q8_quantize(n, k, pw, pq, ps, num_threads);
        }
        return py::make_tuple(q, scales);
      },
      py::arg("w"), py::arg("num_threads") = 1,
      "float32 W (n, k) -> (q int8 (n, k), scales float32 (n, k / 32)), symmetric, per group of 32 columns.");

  m.def(
      "q8_dequantize",
      [](const py::array& q, const py::array& scales, int num_threads) {
        std::size_t n = 0, k = 0;
        check_q8_weights(q, scales, n, k);
        FloatArray w({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(k)});
        const auto* pq = static_cast<const std::int8_t*>(q.data());
        const float* ps = static_cast<const float*>(scales.data());
        float* pw = w.mutable_data();
        {
          py::gil_scoped_release release;
          certrag::q8_dequantize(n, k, pq, ps, pw, num_threads);
        }
        return w;
      },
      py::arg("q"), py::arg("scales"), py::arg("num_threads") = 1, "q8_quantize's inverse: float32 (n, k).");

  py::class_<certrag::Q8Packed>(m, "Q8Packed",
                                "q8 weights packed for the integer product (int8 activations per group of 32 times "
                                "the int8 weights, exact int32 sums per group): the decoder's matrix product.")
      .def(py::init([](const py::array& q, const py::array& scales, int num_threads) {
             std::size_t n = 0, k = 0;
             check_q8_weights(q, scales, n, k);
             if (num_threads < 1)
               throw py::value_error("num_threads must be at least 1; got " + std::to_string(num_threads));
             const auto* pq = static_cast<const std::int8_t*>(q.data());
             const float* ps = static_cast<const float*>(scales.data());
             py::gil_scoped_release release;
             return certrag::q8_pack(n, k, pq, ps, num_threads);
           }),
           py::arg("q"), py::arg("scales"), py::arg("num_threads") = 1)
      .def_property_readonly("shape", [](const certrag::Q8Packed& w) { return py::make_tuple(w.n, w.k); })
      .def_property_readonly("nbytes", &certrag::Q8Packed::nbytes)
      .def(
          "rows",
          [](const certrag::Q8Packed& w, const Int64Ids& idx) {
            if (idx.ndim() != 1) throw py::value_error("ids must be one-dimensional; got shape " + shape_text(idx));
            const auto count = static_cast<std::size_t>(idx.shape(0));
            FloatArray out({static_cast<py::ssize_t>(count), static_cast<py::ssize_t>(w.k)});
            try {
              certrag::q8_packed_rows(w, idx.data(), count, out.mutable_data());
            } catch (const std::out_of_range& e) {
              throw py::index_error(e.what());
            }
            return out;
          },
          py::arg("ids"), "Rows ids of W de-quantised: float32 (len(ids), k).")
      .def(
          "unpack",
          [](const certrag::Q8Packed& w) {
            Int8Array q({static_cast<py::ssize_t>(w.n), static_cast<py::ssize_t>(w.k)});
            FloatArray scales({static_cast<py::ssize_t>(w.n), static_cast<py::ssize_t>(w.k / certrag::kQ8Group)});
            certrag::q8_unpack(w, q.mutable_data(), scales.mutable_data());
            return py::make_tuple(q, scales);
          },
          "The weights in their q8 form: (q int8 (n, k), scales float32 (n, k / 32)).")
      .def(
          "matmul",
          [](const certrag::Q8Packed& w, const py::array& x, int num_threads, const std::string& level) {
            const std::size_t rows = check_matrix(x, "x", w.k);
            if (num_threads < 1)
              throw py::value_error("num_threads must be at least 1; got " + std::to_string(num_threads));
            certrag::Q8Path path;
            if (level == "auto") path = certrag::q8_packed_path();
            else if (level == "vnni") path = certrag::Q8Path::vnni;
            else if (level == "avx2") path = certrag::Q8Path::avx2;
            else if (level == "scalar") path = certrag::Q8Path::scalar;
            else throw py::value_error("level must be 'auto', 'vnni', 'avx2' or 'scalar'; got '" + level + "'");
            if (!certrag::q8_path_supported(path)) throw py::value_error("this CPU does not support " + level);
            FloatArray y({static_cast<py::ssize_t>(rows), static_cast<py::ssize_t>(w.n)});
            const float* px = static_cast<const float*>(x.data());
            float* py_ = y.mutable_data();
            {
              py::gil_scoped_release release;
              certrag::q8_packed_matmul_at(path, rows, px, w, py_, num_threads);
            }
            return y;
          },
          py::arg("x"), py::arg("num_threads") = 1, py::arg("level") = "auto",
          "x (m, k) float32 times W^T: (m, n). Each output element is computed the same way whatever m and "
          "num_threads are, and the same at every level (batch invariant, bit-exact across levels).");
  m.def(
      "decode_attention",
      [](const py::array& q, const py::array& k_new, const py::array& v_new, const py::list& k_caches,
         const py::list& v_caches, std::size_t layer, const std::vector<std::size_t>& lengths, const py::list& spans,
         float scale, int num_threads) {
        auto fail = [](const std::string& what) { throw py::value_error(what); };
        if (!py::isinstance<FloatArray>(q) || !(q.flags() & py::array::c_style) || q.ndim() != 3)
          fail("q must be a C-contiguous float32 array (batch, heads, head_dim); got shape " + shape_text(q));
        const std::size_t B = q.shape(0), H = q.shape(1), D = q.shape(2);
        if (lengths.size() != B || py::len(k_caches) != B || py::len(v_caches) != B || py::len(spans) != B)
          fail("k_caches, v_caches, lengths and spans must have one entry per row of q (" + std::to_string(B) + ")");
        std::size_t KV = 0, layers = 0;
        std::vector<certrag::AttentionRow> rows(B);
        std::vector<py::array> keep;
        py::list masses;
        for (std::size_t b = 0; b < B; ++b) {
          for (int which = 0; which < 2; ++which) {
            py::array c = which == 0 ? k_caches[b].cast<py::array>() : v_caches[b].cast<py::array>();
            if (!py::isinstance<FloatArray>(c) || !(c.flags() & py::array::c_style) || !c.writeable() || c.ndim() != 4)
              fail("each cache must be a writable C-contiguous float32 array (layers, kv_heads, capacity, head_dim); "
                   "got shape " + shape_text(c));
            if (b == 0 && which == 0) layers = c.shape(0), KV = c.shape(1);
            const std::size_t cap = c.shape(2);
            if (static_cast<std::size_t>(c.shape(0)) != layers || static_cast<std::size_t>(c.shape(1)) != KV ||
                static_cast<std::size_t>(c.shape(3)) != D || (which == 1 && cap != rows[b].capacity))
              fail("every cache must have the first's layers and kv_heads, head_dim " + std::to_string(D) +
                   ", and a row's values the shape of its keys; got " + shape_text(c));
            if (layer >= layers)
              fail("layer " + std::to_string(layer) + " is outside [0, " + std::to_string(layers) + ")");
            rows[b].capacity = cap;
            float* base = static_cast<float*>(c.mutable_data()) + layer * KV * cap * D;
            (which == 0 ? rows[b].k : rows[b].v) = base;
            keep.push_back(c);
          }
          if (lengths[b] == 0 || lengths[b] > rows[b].capacity)
            fail("lengths must be in [1, the row's capacity " + std::to_string(rows[b].capacity) + "]; got " +
                 std::to_string(lengths[b]));
          rows[b].length = lengths[b];
          if (spans[b].is_none()) {
            masses.append(py::none());
            continue;
          }
          auto sp = spans[b].cast<py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>>();
          if (sp.ndim() != 2 || sp.shape(1) != 2) fail("spans must be None or int64 (n, 2); got " + shape_text(sp));
          FloatArray m({static_cast<py::ssize_t>(H), static_cast<py::ssize_t>(sp.shape(0))});
          rows[b].spans = sp.data();
          rows[b].n_spans = sp.shape(0);
          rows[b].masses = m.mutable_data();
          keep.push_back(sp);
          masses.append(m);
        }
        if (KV == 0 || H % KV != 0) fail("heads must be a multiple of the caches' kv_heads");
        for (const py::array* a : {&k_new, &v_new})
          if (!py::isinstance<FloatArray>(*a) || !(a->flags() & py::array::c_style) || a->ndim() != 3 ||
              static_cast<std::size_t>(a->shape(0)) != B || static_cast<std::size_t>(a->shape(1)) != KV ||
              static_cast<std::size_t>(a->shape(2)) != D)
            fail("k_new and v_new must be C-contiguous float32 (" + std::to_string(B) + ", " + std::to_string(KV) +
                 ", " + std::to_string(D) + "); got " + shape_text(*a));
        FloatArray out({static_cast<py::ssize_t>(B), static_cast<py::ssize_t>(H * D)});
        const certrag::AttentionShape shape{H, KV, D};
        const float* pq = static_cast<const float*>(q.data());
        const float* pk = static_cast<const float*>(k_new.data());
        const float* pv = static_cast<const float*>(v_new.data());
        float* po = out.mutable_data();
        {
          py::gil_scoped_release release;
          certrag::decode_attention(shape, B, pq, pk, pv, rows.data(), scale, po, num_threads);
        }
        return py::make_tuple(out, masses);
      },
      py::arg("q"), py::arg("k_new"), py::arg("v_new"), py::arg("k_caches"), py::arg("v_caches"), py::arg("layer"),
      py::arg("lengths"), py::arg("spans"), py::arg("scale"), py::arg("num_threads") = 1,
      "One decode step's grouped-query attention for a batch of sequences, each over its own cache: writes row b's "
      "new key and value at position lengths[b] - 1 of layer `layer`, then returns (out (B, heads * head_dim), "
      "masses): masses[b] is None or float32 (heads, n) with the attention weights summed over spans[b]'s [begin, "
      "end) position ranges.");
  m.def(
      "decode_attention_kernel",
      [](std::size_t head_dim) { return std::string(certrag::decode_attention_kernel(head_dim)); },
      py::arg("head_dim"),
      "The kernel decode_attention runs for this head size on this CPU (capped by CERTRAG_SIMD): 'avx512' "
      "(head_dim a multiple of 16), 'avx2' (a multiple of 8, AVX2 + FMA) or 'scalar'.");
  m.def(
      "q8_paths", [] {
        py::list out;
        for (auto p : {certrag::Q8Path::scalar, certrag::Q8Path::avx2, certrag::Q8Path::vnni})
          if (certrag::q8_path_supported(p)) out.append(certrag::q8_path_name(p));
        return out;
      },
      "The packed q8 kernels this CPU runs (Q8Packed.matmul's levels besides 'auto').");

  py::class_<certrag::PairScorer>(m, "PairScorer")
      .def(py::init([](const py::array& w1, const py::array& b1, const py::array& w2, float b2,
                       const std::string& level, const std::string& precision) {
             if (!py::isinstance<FloatArray>(w1) || !(w1.flags() & py::array::c_style) || w1.ndim() != 2 ||
                 w1.shape(1) % 4 != 0 || w1.shape(1) == 0)
               throw py::value_error("w1 must be a C-contiguous float32 array of shape (hidden, 4 * dim); got " +
                                     py::str(w1.dtype()).cast<std::string>() + " of shape " + shape_text(w1));
             const auto hidden = static_cast<std::size_t>(w1.shape(0));
             check_vector(b1, "b1", hidden);
             check_vector(w2, "w2", hidden);
             certrag::PairHeadWeights w;
             w.dim = static_cast<std::uint32_t>(w1.shape(1) / 4);
             w.hidden = static_cast<std::uint32_t>(hidden);
             w.w1 = static_cast<const float*>(w1.data());
             w.b1 = static_cast<const float*>(b1.data());
             w.w2 = static_cast<const float*>(w2.data());
             w.b2 = b2;
             const std::string problem = w.validate();
             if (!problem.empty()) throw py::value_error(problem);
             const auto lv = parse_level(level);
             if (!certrag::cpu_supports(lv)) throw py::value_error("this CPU does not support " + level);
             if (precision != "float32" && precision != "bfloat16")
               throw py::value_error("precision must be 'float32' or 'bfloat16'; got '" + precision + "'");
             const auto pr = precision == "bfloat16" ? certrag::PairPrecision::bfloat16 : certrag::PairPrecision::float32;
             if (pr == certrag::PairPrecision::bfloat16 && !certrag::cpu_supports_bf16())
               throw py::value_error("precision='bfloat16' needs a CPU with AVX512_BF16");
             return std::make_unique<certrag::PairScorer>(w, lv, pr);
           }),
           py::arg("w1"), py::arg("b1"), py::arg("w2"), py::arg("b2"), py::arg("level") = "auto",
           py::arg("precision") = "float32")
      .def(
          "score_adjacent",
          [](const certrag::PairScorer& self, const py::array& x, int num_threads) {
            const std::size_t n = check_matrix(x, "embeddings", self.dim());
            FloatArray out(static_cast<py::ssize_t>(n > 0 ? n - 1 : 0));
            const float* px = static_cast<const float*>(x.data());
            float* po = out.mutable_data();
            {
              py::gil_scoped_release release;
              self.score_adjacent(n, px, po, num_threads);
            }
            return out;
          },
          py::arg("embeddings"), py::arg("num_threads") = 0)
      .def_property_readonly("dim", &certrag::PairScorer::dim)
      .def_property_readonly("hidden", &certrag::PairScorer::hidden)
      .def_property_readonly("level", [](const certrag::PairScorer& self) { return certrag::simd_level_name(self.level()); })
      .def_property_readonly("precision", [](const certrag::PairScorer& self) {
        return self.precision() == certrag::PairPrecision::bfloat16 ? "bfloat16" : "float32";
      });

  py::class_<HnswIndex>(m, "HnswIndex")
      .def(py::init([](std::uint32_t dim, const std::string& metric, std::uint32_t M, std::uint32_t ef_construction,
                       std::uint64_t seed) {
             certrag::HnswConfig c;
             c.dim = dim;
             c.metric = parse_metric(metric);
             c.M = M;
             c.ef_construction = ef_construction;
             c.seed = seed;
             const std::string problem = c.validate();
             if (!problem.empty()) throw py::value_error(problem);
             return std::make_unique<HnswIndex>(c);
           }),
           py::arg("dim"), py::arg("metric"), py::arg("M"), py::arg("ef_construction"), py::arg("seed"))
      .def("add",
           [](HnswIndex& self, const py::array& vectors, const py::array& labels, int num_threads) {
             const std::size_t n = check_matrix(vectors, "vectors", self.config().dim);
             check_labels(labels, "ids", n);
             const float* v = static_cast<const float*>(vectors.data());
             const auto* l = static_cast<const std::int64_t*>(labels.data());
             py::gil_scoped_release release;
             self.add(n, v, l, num_threads);
           })
      .def("search",
           [](const HnswIndex& self, const py::array& queries, std::size_t k, std::size_t ef, int num_threads) {
             const std::size_t n = check_matrix(queries, "queries", self.config().dim);
             if (k < 1) throw py::value_error("k must be at least 1");
             // results are sized by what the index holds: k = 2**31 on 50 vectors must not allocate k x n
             k = std::min(k, self.size());
             LabelArray ids({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(k)});
             FloatArray scores({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(k)});
             const float* q = static_cast<const float*>(queries.data());
             std::int64_t* pi = ids.mutable_data();
             float* ps = scores.mutable_data();
             {
               py::gil_scoped_release release;
               self.search(n, q, k, ef, num_threads, pi, ps);
             }
             return py::make_tuple(ids, scores);
           })
      .def("remove",
           [](HnswIndex& self, const py::array& labels) {
             const std::size_t n = check_labels(labels, "ids", static_cast<std::size_t>(-1));
             const auto* l = static_cast<const std::int64_t*>(labels.data());
             py::gil_scoped_release release;
             return self.remove(n, l);
           })
      .def("get_vectors",
           [](const HnswIndex& self, const py::array& labels) {
             const std::size_t n = check_labels(labels, "ids", static_cast<std::size_t>(-1));
             FloatArray out({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(self.config().dim)});
             const auto* l = static_cast<const std::int64_t*>(labels.data());
             float* po = out.mutable_data();
             {
               py::gil_scoped_release release;
               self.get_vectors(n, l, po);
             }
             return out;
           })
      .def("contains", &HnswIndex::contains)
      .def("size", &HnswIndex::size)
      .def("max_label", &HnswIndex::max_label)
      .def("labels",
           [](const HnswIndex& self) {
             std::vector<std::int64_t> labels;
             {
               py::gil_scoped_release release;
               labels = self.labels();
             }
             LabelArray out(static_cast<py::ssize_t>(labels.size()));
             std::copy(labels.begin(), labels.end(), out.mutable_data());
             return out;
           })
      .def_property_readonly("dim", [](const HnswIndex& self) { return self.config().dim; })
      .def_property_readonly("metric", [](const HnswIndex& self) { return certrag::metric_name(self.config().metric); })
      .def_property_readonly("M", [](const HnswIndex& self) { return self.config().M; })
      .def_property_readonly("ef_construction", [](const HnswIndex& self) { return self.config().ef_construction; })
      .def_property_readonly("seed", [](const HnswIndex& self) { return self.config().seed; })
      .def("stats",
           [](const HnswIndex& self) {
             certrag::HnswStats s;
             {
               py::gil_scoped_release release;
               s = self.stats();
             }
             py::dict d;
             d["nodes"] = s.nodes;
             d["live"] = s.live;
             d["deleted"] = s.deleted;
             d["capacity"] = s.capacity;
             d["max_level"] = s.max_level;
             d["nodes_per_level"] = s.nodes_per_level;
             d["mean_degree_level0"] = s.mean_degree_level0;
             d["memory_bytes"] = s.memory_bytes;
             d["mmapped"] = s.mmapped;
             return d;
           })
      .def("save",
           [](const HnswIndex& self, const std::string& path) {
             py::gil_scoped_release release;
             self.save(path);
           })
      .def_static(
          "load",
          [](const std::string& path, bool use_mmap) {
            py::gil_scoped_release release;
            return HnswIndex::load(path, use_mmap);
          },
          py::arg("path"), py::arg("mmap"));
}
