"""Start from a Hugging Face Llama folder (`model.init_from=PATH`): its shape from config.json, its weights at step 0.

Continued pretraining (Swallow, ELYZA, Youri, the GENIAC teams) starts from an open Llama-family
model. ayumi's parameter names are Hugging Face's (pretrain/tools/export.py), so importing is: read
config.json into ModelConfig's fields, refusing by name anything ayumi's Llama does not compute
the same way, then copy each tensor from the folder's safetensors (one file or an index of
shards) into the model as it is built. Nothing is downloaded: PATH is a local folder.

Reading config.json and the safetensors headers needs no torch, so `ayumi train`/`ayumi plan` apply
the shape, and `ayumi train` checks every tensor's name and shape against it, before any rank starts;
the tensors are read by the ranks (under ZeRO-3 by rank 0 only, one tensor at a time, so no rank
holds the whole model).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pretrain.model.config import RopeScaling

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
MODEL_TYPES = ("llama", "mistral")
"""config.json model types with Llama's architecture (Mistral only without a sliding window)."""
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
"""transformers' RoPE types ayumi computes (pretrain/model/rope.py); "default" is plain RoPE."""
NEW_TOKEN_INITS = ("base_mean", "mean", "random")
"""How rows of a grown vocabulary start (pretrain/model/resize.py)."""
VOCAB_MULTIPLE = 64
"""A vocabulary grown from the tokenizer is padded to a multiple of this (tensor-core friendly shapes on GPUs)."""


def padded_vocab(size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-size // multiple) * multiple


class HFImportError(ValueError):
    """A Hugging Face folder cannot start this run; the message names the folder, the field and the fix."""


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """config.json of a local transformers folder."""
    path = Path(folder) / CONFIG_FILE
    if not Path(folder).is_dir():
        raise HFImportError(f"model.init_from={folder}: no such folder (a local transformers folder with config.json "
                            "and *.safetensors; nothing is downloaded)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFImportError(f"model.init_from={folder}: {path} does not exist: not a transformers model folder") from None
    except (OSError, json.JSONDecodeError) as err:
        raise HFImportError(f"{path} cannot be read ({err})") from None


def model_fields(hf: dict[str, Any], folder: str | Path) -> dict[str, Any]:
    """ModelConfig fields for an HF Llama config; HFImportError naming every feature ayumi does not support."""
    where = Path(folder) / CONFIG_FILE
    problems = unsupported(hf)
    if problems:
        raise HFImportError(f"{where}: " + "; ".join(problems) + ". ayumi trains plain Llama blocks; start from a "
                            "model without these, or convert it first")
    heads = int(hf["num_attention_heads"])
    return {
        "name": Path(folder).resolve().name,
        "vocab_size": int(hf["vocab_size"]),
        "hidden_size": int(hf["hidden_size"]),
        "intermediate_size": int(hf["intermediate_size"]),
        "num_layers": int(hf["num_hidden_layers"]),
        "num_heads": heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "max_seq_len": int(hf["max_position_embeddings"]),
        "rope_theta": float(rope_settings(hf).get("rope_theta", 10000.0)),
        "rope_scaling": scaling_from_hf(rope_settings(hf), int(hf["max_position_embeddings"])),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "init_std": float(hf.get("initializer_range", 0.02)),
        "qk_norm": False,
    }


def rope_settings(hf: dict[str, Any]) -> dict[str, Any]:
    """RoPE parameters in one dict, as transformers 5 keeps them (`rope_parameters`: rope_type, rope_theta and the
    scaling's parameters); transformers 4.x writes `rope_theta` and `rope_scaling` (with `type` in early files).

    A scaling in either place wins over "default" in the other."""
    settings = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    if scaling.get("rope_type", scaling.get("type")) not in (None, "default") or not settings:
        settings.update(scaling)
    if "rope_theta" in hf:
        settings.setdefault("rope_theta", hf["rope_theta"])
    settings["rope_type"] = settings.pop("rope_type", None) or settings.pop("type", None) or "default"
    return settings


HF_ROPE_KEYS = {"factor": "factor", "original_max_position_embeddings": "original_max_seq_len",
                "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor", "beta_fast": "beta_fast",
                "beta_slow": "beta_slow", "attention_factor": "attention_factor", "mscale": "mscale",
                "mscale_all_dim": "mscale_all_dim", "truncate": "truncate"}
"""transformers' RoPE parameter -> RopeScaling field."""


def scaling_from_hf(parameters: dict[str, Any], max_position_embeddings: int) -> dict[str, Any]:
    """RopeScaling's fields from transformers' RoPE parameters (type already checked to be one ayumi computes).

    As transformers does: llama3 and yarn without original_max_position_embeddings take max_position_embeddings;
    dynamic's original length is max_position_embeddings itself."""
    kind = parameters["rope_type"]
    if kind == "default":
        return {"type": "none"}
    values = {"type": kind}
    for hf_key, field in HF_ROPE_KEYS.items():
        if parameters.get(hf_key) is not None:
            values[field] = type(getattr(RopeScaling, field))(parameters[hf_key])
    if kind == "dynamic" or (kind in ("llama3", "yarn") and not values.get("original_max_seq_len")):
        values["original_max_seq_len"] = int(max_position_embeddings)
    return values


def scaling_to_hf(scaling: RopeScaling, max_seq_len: int) -> dict[str, Any] | None:
    """transformers' `rope_scaling` for `scaling` (None for plain RoPE): every parameter its type reads."""
    if scaling.type == "none":
        return None
    out: dict[str, Any] = {"rope_type": scaling.type, "factor": float(scaling.factor)}
    wanted = {"llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
              "yarn": ("original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
                       "mscale_all_dim", "truncate"),
              "linear": (), "dynamic": ()}[scaling.type]
    for hf_key in wanted:
        value = getattr(scaling, HF_ROPE_KEYS[hf_key])
        if hf_key == "original_max_position_embeddings":
            value = scaling.original_max_seq_len or max_seq_len
        if hf_key in ("attention_factor", "mscale", "mscale_all_dim") and not value:
            continue  # 0 = unset: transformers derives it the same way
        out[hf_key] = value
    return out


def unsupported(hf: dict[str, Any]) -> list[str]:
    """Every config.json setting whose network ayumi's Llama would compute differently, by name."""
    problems = []
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        problems.append(f"model_type={model_type!r} (supported: {', '.join(MODEL_TYPES)})")
    if hf.get("sliding_window"):
        problems.append(f"sliding_window={hf['sliding_window']} (ayumi attends over the whole sequence)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (ayumi's MLP is SwiGLU with silu)")
    if hf.get("attention_dropout"):
        problems.append(f"attention_dropout={hf['attention_dropout']} (ayumi's attention has no dropout)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            problems.append(f"{key}=true (ayumi's projections have no bias)")
    rope = rope_settings(hf)
    if rope["rope_type"] not in ROPE_TYPES:
        problems.append(f"RoPE scaling {rope['rope_type']!r} (ayumi computes plain RoPE and the "
                        f"{', '.join(ROPE_TYPES[1:])} scalings)")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        problems.append(f"partial_rotary_factor={partial} (ayumi rotates every dimension of a head)")
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    head_dim = hf.get("head_dim")
    if head_dim is not None and heads and hidden and head_dim != hidden // heads:
        problems.append(f"head_dim={head_dim} differs from hidden_size/num_attention_heads={hidden // heads}")
    if hf.get("pretraining_tp", 1) != 1:
        problems.append(f"pretraining_tp={hf['pretraining_tp']} (use a folder saved with pretraining_tp=1)")
    missing = [key for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "max_position_embeddings") if key not in hf]
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    return problems


def contradictions(fields: dict[str, Any], explicit: dict[str, Any]) -> list[str]:
    """`model.*` values set on the command line that disagree with the folder's config.json.

    A larger vocab_size is not one: it grows the embedding for an expanded tokenizer. Nor are the settings of a
    context extension: a larger max_seq_len, rope_theta and model.rope_scaling.* (not a field here).
    """
    problems = []
    for key, value in sorted(explicit.items()):
        if key not in fields or key in ("name", "rope_theta") or not _differs(value, fields[key]):
            continue
        if key in ("vocab_size", "max_seq_len") and str(value).isdigit() and int(value) > fields[key]:
            continue
        problems.append(f"model.{key}={value} contradicts model.init_from's config.json ({key} = {fields[key]}); "
                        + ("the vocabulary can only grow" if key == "vocab_size" else
                           "the context can only grow" if key == "max_seq_len" else
                           "drop the override (the shape comes from the folder)"))
    return problems


def tokenizer_vocab(tokenizer_dir: str | None) -> int | None:
    """Pieces of an ayumi tokenizer folder (its tokenizer_meta.json; no library needed), else None."""
    if not tokenizer_dir:
        return None
    meta = Path(tokenizer_dir) / "tokenizer_meta.json"
    try:
        return int(json.loads(meta.read_text(encoding="utf-8"))["vocab_size"])
    except (OSError, ValueError, KeyError):
        return None


def _differs(given: Any, wanted: Any) -> bool:
    if isinstance(wanted, bool):
        return str(given).lower() not in (str(wanted).lower(),)
    if isinstance(wanted, float):
        return abs(float(given) - wanted) > 1e-12 * max(1.0, abs(wanted))
    return str(given) != str(wanted)


SAFETENSORS_HEADER_LIMIT = 100_000_000
"""Largest header the safetensors format allows (bytes): a bigger length field means the file is not one."""


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a .safetensors file's header (8 bytes of length, then JSON): no tensor is read and
    no torch imported, so `ayumi train` can check a folder before any rank starts."""
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 2 <= length <= SAFETENSORS_HEADER_LIMIT:
                raise ValueError(f"header length {length}")
            header = json.loads(handle.read(length))
        return {name: tuple(int(size) for size in entry["shape"])
                for name, entry in header.items() if name != "__metadata__"}
    except FileNotFoundError:
        raise HFImportError(f"{path} does not exist, but {SAFETENSORS_INDEX} lists it: the folder is incomplete. "
                            "Fix: copy the missing file, or save the model again") from None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise HFImportError(f"{path} is not a readable safetensors file ({err}): the file is damaged or "
                            "incomplete. Fix: copy it again, or save the model again") from None


class HFWeights:
    """The tensors of a folder's safetensors (`model.safetensors`, or shards listed in its index), read one at a time.

    Their names and shapes come from the files' headers alone (`check` needs no torch); `tensor` reads one."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.shapes: dict[str, tuple[int, ...]] = {}
        """Name -> shape of every tensor the files' headers list."""
        self.files = self._tensor_files()

    def _tensor_files(self) -> dict[str, Path]:
        index = self.folder / SAFETENSORS_INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            for file in sorted(set(weight_map.values())):
                self.shapes.update(safetensors_shapes(self._inside(index, file)))
            return {name: self.folder / file for name, file in weight_map.items()}
        single = self.folder / SAFETENSORS_FILE
        if single.is_file():
            self.shapes = safetensors_shapes(single)
            return {name: single for name in self.shapes}
        other = sorted(p.name for p in self.folder.glob("*.bin")) + sorted(p.name for p in self.folder.glob("*.pt*"))
        hint = (f" (it has {', '.join(other[:3])}: save it with safe_serialization=True, e.g. "
                "`LlamaForCausalLM.from_pretrained(PATH).save_pretrained(NEW)`)") if other else ""
        raise HFImportError(f"model.init_from={self.folder}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX}{hint}")

    def _inside(self, index: Path, file: object) -> Path:
        """The shard `file` that `index` names, once it is a plain name inside the folder (no absolute name, no `..`,
        no link leading out): an index could otherwise have any safetensors of this machine read as the model."""
        resolved_folder = self.folder.resolve()
        path = self.folder / file if isinstance(file, str) else None
        if path is None or Path(file).is_absolute() or ".." in Path(file).parts or \
                not path.resolve().is_relative_to(resolved_folder):
            raise HFImportError(f"{index}: weight_map names {file!r}, outside {self.folder}: an index may name only "
                                "files inside its folder (no absolute names, no '..', no links leading out). Fix: "
                                "take the folder from a source you trust, or save it again with save_pretrained")
        return path

    def check(self, shapes: dict[str, tuple[int, ...]], tied: bool, grown_vocab: bool = False) -> None:
        """Every parameter the model needs is there with its shape (a tied lm_head may be absent; with
        `grown_vocab`, the embedding and LM head may have fewer rows: they grow, pretrain/model/resize.py)."""
        needed = {name: shape for name, shape in shapes.items() if not (tied and name == "lm_head.weight")}
        missing = sorted(set(needed) - (set(self.files) & set(self.shapes)))  # listed by the index and in its file
        if missing:
            raise HFImportError(f"model.init_from={self.folder}: tensors missing from its safetensors: "
                                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}. Fix: a folder whose "
                                f"{CONFIG_FILE} describes its weights (the model's shape comes from {CONFIG_FILE})")
        for name, shape in needed.items():
            found = self.shapes[name]
            grows = grown_vocab and name in ("model.embed_tokens.weight", "lm_head.weight") \
                and found[1:] == tuple(shape)[1:] and found[0] <= shape[0]
            if found != tuple(shape) and not grows:
                raise HFImportError(f"model.init_from={self.folder}: {name} has shape {found}, the model needs {shape}")

    def tensor(self, name: str):
        """One tensor, as stored (the caller casts it into the parameter)."""
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as handle:
            return handle.get_tensor(name)


def check_init_from(model_cfg) -> HFWeights | None:
    """model.init_from's tensors checked against the model's shapes (ModelConfig `model_cfg`, its shape taken from the
    folder's config.json), or None without init_from. From the safetensors headers only: `ayumi train` runs it before
    any rank starts, and each rank again before it reads a tensor."""
    if not model_cfg.init_from:
        return None
    from pretrain.model.flops import parameter_shapes

    weights = HFWeights(model_cfg.init_from)
    base_vocab = int(read_hf_config(model_cfg.init_from)["vocab_size"])
    weights.check(parameter_shapes(model_cfg), model_cfg.tie_embeddings, grown_vocab=model_cfg.vocab_size > base_vocab)
    return weights
