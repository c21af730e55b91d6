"""Token prices and cost: cost = input_tokens * c_in + output_tokens * c_out (SAGE section 4.4).

Prices are per million tokens and set per model name, with "*" as the fallback. The default table is a placeholder
(0.10 in / 0.40 out per million, the 1:4 ratio common in hosted APIs) so that cost-efficiency is finite for local
models; set real prices with PriceTable.from_json or PriceTable({...}).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Price:
    input_per_million: float
    output_per_million: float

    def __post_init__(self) -> None:
        if self.input_per_million < 0 or self.output_per_million < 0:
            raise ValueError("prices must be >= 0")


class PriceTable:
    def __init__(self, prices: dict[str, Price | tuple[float, float]] | None = None) -> None:
        prices = dict(prices or {"*": Price(0.10, 0.40)})
        self.prices = {k: v if isinstance(v, Price) else Price(*v) for k, v in prices.items()}

    @classmethod
    def from_json(cls, path: str | Path) -> "PriceTable":
        data = json.loads(Path(path).read_text())
        return cls({k: Price(float(v[0]), float(v[1])) for k, v in data.items()})

    def price(self, model: str) -> Price:
        if model in self.prices:
            return self.prices[model]
        if "*" in self.prices:
            return self.prices["*"]
        raise KeyError(f"no price for model {model!r} and no '*' fallback")

    def cost(self, model: str, input_tokens: int, output_tokens: int) -> float:
        p = self.price(model)
        return (input_tokens * p.input_per_million + output_tokens * p.output_per_million) / 1e6


def cost_efficiency(accuracy: float, cost: float) -> float:
    """accuracy / cost (SAGE's cost-efficiency); infinite when the cost is zero and accuracy is not."""
    if cost <= 0:
        return float("inf") if accuracy > 0 else 0.0
    return accuracy / cost
