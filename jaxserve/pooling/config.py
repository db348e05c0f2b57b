"""Which runner a model gets and how it pools: read once at start, from the model directory and the flags.

1. `resolve_runner` follows vLLM's `--runner auto`: a directory that sentence-transformers saved
   (`modules.json`), or an architecture named `...Model` rather than `...ForCausalLM` (a bare decoder,
   as Qwen3-Embedding ships), embeds; everything else generates.
2. `PoolerConfig.for_model` starts from the model's sentence-transformers files (the `Pooling` module's
   `1_Pooling/config.json` mode, a `Normalize` module in `modules.json`), else from the default of
   decoder embedding models (last token, normalized), then applies `--pooler-config` (vLLM's JSON).
   Matryoshka sizes come from the model's `config.json` (`matryoshka_dimensions` / `is_matryoshka`).
No JAX here: the CLI and the server read this without loading the engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from jaxserve.errors import InvalidParameter
from jaxserve.json_files import json_object_option, read_json_object

logger = logging.getLogger(__name__)

RUNNERS = ("auto", "generate", "pooling")
# The pooling kind of a sequence row, as the pool head reads it (`execution/heads/pool.py: PoolBatch.kind`).
LAST, MEAN, CLS = 0, 1, 2
POOLING_TYPES = {"LAST": LAST, "MEAN": MEAN, "CLS": CLS}
# sentence-transformers' `1_Pooling/config.json` switches -> our pooling types (the others are refused).
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_OVERRIDABLE = ("pooling_type", "normalize")


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """How an embedding model turns a prompt's hidden states into one vector."""
    pooling_type: str = "LAST"  # LAST | MEAN | CLS
    normalize: bool = True  # L2-normalize the vector (a request's `normalize` may override)
    # Sizes the model was trained to be cut to (Matryoshka); () when it was not: `dimensions` is refused.
    # An empty tuple with `matryoshka` True means any size up to the hidden size.
    matryoshka_dimensions: tuple[int, ...] = ()
    matryoshka: bool = False
    hidden_size: int | None = None
    # sentence-transformers' `max_seq_length` (sentence_bert_config.json): the context the model was trained
    # for, and the default context length of a pooling engine, as in vLLM.
    max_seq_length: int | None = None

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")

    @property
    def kind(self) -> int:
        return POOLING_TYPES[self.pooling_type]

    def check_dimensions(self, dimensions: int | None) -> None:
        """Refuse a `dimensions` the model cannot give (an InvalidParameter naming it)."""
        if dimensions is None:
            return
        if not self.matryoshka:
            raise InvalidParameter("dimensions", "this model does not support Matryoshka embeddings: "
                                                 "'dimensions' cannot be set")
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            raise InvalidParameter("dimensions", f"dimensions must be a positive integer, got {dimensions!r}")
        if self.hidden_size is not None and dimensions > self.hidden_size:
            raise InvalidParameter("dimensions", f"dimensions may be at most the model's {self.hidden_size}")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            sizes = ", ".join(map(str, self.matryoshka_dimensions))
            raise InvalidParameter("dimensions", f"this model supports dimensions {sizes}; got {dimensions}")

    @classmethod
    def for_model(cls, model_dir: str | Path | None, overrides: dict | str | None = None) -> PoolerConfig:
        """The model's pooling (sentence-transformers files, config.json), then `overrides` on top."""
        settings: dict = {}
        hf: dict = {}
        if model_dir is not None:
            directory = Path(model_dir)
            settings = _sentence_transformers_pooling(directory)
            hf = read_json_object(directory / "config.json")
            max_seq_length = read_json_object(directory / "sentence_bert_config.json").get("max_seq_length")
            if max_seq_length:
                settings["max_seq_length"] = int(max_seq_length)
        settings.update(parse_pooler_overrides(overrides))
        dims = hf.get("matryoshka_dimensions") or ()
        config = cls(**settings, matryoshka_dimensions=tuple(int(d) for d in dims),
                     matryoshka=bool(dims) or bool(hf.get("is_matryoshka")), hidden_size=hf.get("hidden_size"))
        logger.info("pooling: %s, normalize %s%s", config.pooling_type, config.normalize,
                    ", Matryoshka" if config.matryoshka else "")
        return config


def resolve_runner(runner: str, model_dir: str | Path | None) -> str:
    """`generate` or `pooling` for `--runner` (`auto` decides from the model directory, as vLLM does)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if runner != "auto":
        return runner
    if model_dir is None:
        return "generate"
    directory = Path(model_dir)
    if (directory / "modules.json").is_file():
        return "pooling"
    architectures = read_json_object(directory / "config.json").get("architectures") or []
    if architectures and all(a.endswith("Model") for a in architectures):
        return "pooling"
    return "generate"


def _sentence_transformers_pooling(directory: Path) -> dict:
    """The settings a sentence-transformers directory declares: its Pooling module's mode and whether a
    Normalize module follows. Empty when the directory has no modules.json."""
    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        return {}
    modules = json.loads(modules_file.read_text())
    types = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    settings: dict = {"normalize": "Normalize" in types}
    pooling = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
    if pooling is not None and (directory / pooling.get("path", "") / "config.json").is_file():
        mode = read_json_object(directory / pooling["path"] / "config.json")
        unsupported = [k for k in _ST_UNSUPPORTED if mode.get(k)]
        chosen = [ours for key, ours in _ST_MODES.items() if mode.get(key)]
        if unsupported or len(chosen) > 1:
            raise ValueError(f"{directory}: the sentence-transformers pooling {unsupported or chosen} is not "
                             f"supported: one of last token, mean or CLS pooling")
        if chosen:
            settings["pooling_type"] = chosen[0]
        if mode.get("include_prompt") is False:
            raise ValueError(f"{directory}: include_prompt false (pooling that skips an instruction prefix) "
                             f"is not supported")
    return settings


def parse_pooler_overrides(overrides: dict | str | None) -> dict:
    """`--pooler-config` as vLLM spells it: JSON with `pooling_type` and `normalize`; other keys refused."""
    if overrides is None:
        return {}
    overrides = json_object_option(overrides, "pooler_config", '{"pooling_type": "MEAN"}')
    unknown = sorted(set(overrides) - set(_OVERRIDABLE))
    if unknown:
        raise ValueError(f"pooler_config: {', '.join(unknown)} not supported (supported: {', '.join(_OVERRIDABLE)})")
    settings = dict(overrides)
    if "pooling_type" in settings:
        settings["pooling_type"] = str(settings["pooling_type"]).upper()
        if settings["pooling_type"] not in POOLING_TYPES:
            raise ValueError(f"pooler_config pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {overrides['pooling_type']!r}")
    if "normalize" in settings and not isinstance(settings["normalize"], bool):
        raise ValueError(f"pooler_config normalize must be true or false, got {settings['normalize']!r}")
    return settings
