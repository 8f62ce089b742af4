"""DeepSpeed's checkpoint formats, read and converted without a running engine.

- `convert_to_universal`: a ZeRO 1-3 checkpoint to DeepSpeed's universal form, which any number of ranks
  (and another tensor-parallel size) can load; `optimizer_layout` says from the files which sizes a folder's
  optimizer states were cut for, `foreign_name` finds a parameter name the model does not have (DeepSpeed's
  converter makes paths of these names, so none but the model's own may reach it);
- `consolidated_state_dict` / `tensor_parallel_slices`: the full fp32 weights of a checkpoint of any ZeRO
  stage and tensor-parallel size, on the CPU, for export.

The checkpointer (pretrain/checkpoint/) decides when these run; they live here because they call DeepSpeed.
DeepSpeed's readers pass `weights_only=False` to torch.load; here they run with torch's weights-only switch on
(common.safe_load.forced_weights_only, FORCE_ENV for the converter's process) and DeepSpeed's few objects allowed,
so no file they read can run code, whoever wrote it.
"""
from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path

import torch

from common.safe_load import DEEPSPEED_GLOBALS, FORCE_ENV, UnsafeFile, forced_weights_only, refused_by_torch
from common.safe_load import load as load_plain
from pretrain.model.tensor_parallel import merge_shards

_CONVERTER = ("import json, runpy, sys; from pretrain.engine.checkpoint_formats import gate_for_conversion; "
              "gate_for_conversion(json.load(sys.stdin)); "
              "runpy.run_module('deepspeed.checkpoint.ds_to_universal', run_name='__main__')")
"""DeepSpeed's converter (`python -m deepspeed.checkpoint.ds_to_universal`) behind `gate_for_conversion`, given the
model's own parameter names on stdin. Its worker processes are forked and inherit the gate."""

REFUSED = "ayumi refused: "
"""How the converter's process says why it stopped (one line on its output, read back by `convert_to_universal`)."""


class ConversionRefused(ValueError):
    """The converter's process refused a file as it read it (one line naming the file and why)."""


def gate_for_conversion(own_names: list[str]) -> None:
    """Set up the converter's process: every torch.load goes through ayumi's gate (checked and loaded from one open
    file, weights-only, DeepSpeed's few objects allowed; FORCE_ENV too, for a load that would bypass it), and every
    parameter name in a DeepSpeed file it reads must be one of `own_names`, checked as the file is read, in the process
    that makes paths of them: a file put in place after the resume's own check is refused all the same."""
    import torch

    from common.safe_load import gate_torch_load, resolve

    os.environ.update(FORCE_ENV)
    torch.serialization.add_safe_globals(resolve(DEEPSPEED_GLOBALS))
    own = set(own_names)

    def names_checked(path: Path, state) -> None:
        kind = "model" if path.name.endswith("model_states.pt") else "optim" if path.name.endswith(
            "optim_states.pt") else None
        if kind is None or not isinstance(state, dict):
            return
        for name in _names_in(state, kind):
            if not isinstance(name, str) or name not in own:
                _refuse(f"{path} names a parameter this model does not have ({name!r})")

    gate_torch_load(DEEPSPEED_GLOBALS, then=names_checked, refused=_refuse)


def _refuse(line: str):
    """Say why on the converter's output, then stop its process (a worker's exception may not survive pickling)."""
    print("\n" + REFUSED + line, flush=True)
    os._exit(2)


def convert_to_universal(tag_dir: Path, out_dir: Path, own_names: set[str]) -> None:
    """Write DeepSpeed's universal form of a ZeRO 1-3 checkpoint folder to `out_dir` (atomically). `own_names`: the
    model's parameter names, the only ones a file may hold (the converter makes paths of them); ConversionRefused,
    one line, when a file it reads holds another or holds more than tensors and plain data.

    A ZeRO checkpoint's optimizer state is cut for the data-parallel size that saved it; the
    universal form holds every parameter's fp32 weights and Adam moments whole, so any number of
    ranks can load it (docs/deepspeed-on-cpu.md). DeepSpeed's converter runs in a child process:
    it starts worker pools of its own, which a process holding threads and a process group
    should not fork.
    """
    import json
    import subprocess
    import sys

    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Each extract worker holds one rank's optimizer shard in memory: a few, not one per core.
    extract_workers = max(1, min(4, (os.cpu_count() or 1) // 4))
    command = [sys.executable, "-c", _CONVERTER, "--input_folder", str(tag_dir),
               "--output_folder", str(partial), "--inject_missing_state", "--num_extract_workers", str(extract_workers),
               "--num_merge_workers", "1"]
    # The converter works on the CPU; keep it off the GPUs this job's ranks already fill.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", **FORCE_ENV, "PYTHONSAFEPATH": "1"}
    done = subprocess.run(command, input=json.dumps(sorted(own_names)), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env)
    if done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        # A progress bar may share the line (tqdm ends its lines with \r): the reason is what follows the marker.
        refused = [line.split(REFUSED, 1)[1] for line in done.stdout.splitlines() if REFUSED in line]
        if refused:
            raise ConversionRefused(f"{refused[0]}: DeepSpeed's conversion stopped as it read the file, nothing of it "
                                    "was loaded. Fix: load a checkpoint of this model from a source you trust")
        raise RuntimeError(f"converting {tag_dir} to a universal checkpoint failed (exit {done.returncode}):\n"
                           f"{done.stdout[-3000:]}")
    partial.rename(out_dir)


_OPTIM_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def optimizer_layout(tag_dir: Path) -> tuple[int, int] | None:
    """(data-parallel size, tensor-parallel size) a ZeRO 1-3 checkpoint folder's optimizer states were cut for, from
    DeepSpeed's per-rank file names (`zero_pp_rank_<dp>_mp_rank_<tp>_optim_states.pt`); None when it holds none.
    The files, not ayumi.json, say it: a record anyone can edit must not decide a conversion."""
    ranks = [(int(m.group(1)), int(m.group(2))) for path in Path(tag_dir).iterdir()
             if (m := _OPTIM_SHARD.match(path.name))]
    if not ranks:
        return None
    return len({dp for dp, _ in ranks}), len({tp for _, tp in ranks})


def _keys(mapping) -> list:
    """A dict's keys; anything else where a dict belongs is itself the odd name (so it is refused, not skipped)."""
    return list(mapping) if isinstance(mapping, dict) else [mapping]


def _names_in(state: dict, kind: str) -> list:
    """The parameter names a DeepSpeed model-states (`kind` "model") or optimizer-states file holds."""
    if kind == "model":
        shapes = state.get("param_shapes") or []
        shared = state.get("shared_params") or {}
        names = _keys(state.get("module") or {}) + list(state.get("buffer_names") or [])
        names += [name for group in (shapes if isinstance(shapes, list) else [shapes]) for name in _keys(group)]
        names += _keys(state.get("frozen_param_shapes") or {}) + _keys(state.get("frozen_param_fragments") or {})
        return names + _keys(shared) + (list(shared.values()) if isinstance(shared, dict) else [])
    optimizer = state.get("optimizer_state_dict") or {}
    mappings = optimizer.get("param_slice_mappings") or [] if isinstance(optimizer, dict) else [optimizer]
    return [name for group in (mappings if isinstance(mappings, list) else [mappings]) for name in _keys(group)]


def foreign_name(tag_dir: Path, own: set[str]) -> tuple[Path, object] | None:
    """(file, name) for the first parameter name in a checkpoint folder's DeepSpeed files (the model states' weights,
    `param_shapes` and the rest, each optimizer shard's `param_slice_mappings`) that is not one of `own` (the model's
    own names); None when every name is. DeepSpeed's universal converter joins these names to its output folder
    (`os.path.join(output, name)`), so `../x` or `/abs` would write outside it. Files are read weights-only, their
    tensors mapped, never read (the names cost the pickles only)."""
    files = sorted(Path(tag_dir).glob("*model_states.pt")) + sorted(Path(tag_dir).glob("*optim_states.pt"))
    for path in files:
        state = load_plain(path, DEEPSPEED_GLOBALS, mapped=True)
        for name in _names_in(state, "model" if path.name.endswith("model_states.pt") else "optim"):
            if not isinstance(name, str) or name not in own:
                return path, name
    return None


# -- consolidation for export -------------------------------------------------------------------
def consolidated_state_dict(root: Path, tag: str) -> dict[str, torch.Tensor]:
    """Full fp32 weights from a checkpoint of any ZeRO stage and tensor-parallel size, on CPU, without a
    process group: each tensor-parallel rank's slices merged (pretrain.model.tensor_parallel.merge_shards)."""
    return merge_shards(tensor_parallel_slices(root, tag))


def tensor_parallel_slices(root: Path, tag: str) -> list[dict[str, torch.Tensor]]:
    """Each tensor-parallel rank's fp32 weights of checkpoint root/tag, in rank order (one whole state without
    tensor parallelism)."""
    import tempfile

    tag_dir = Path(root) / tag
    tp = checkpoint_tensor_parallel(tag_dir)
    if tp == 1:
        return [_fp32_weights(tag_dir)]
    with tempfile.TemporaryDirectory(prefix="ayumi-tp-ranks-") as scratch:
        return [_fp32_weights(_tp_rank_view(tag_dir, rank, Path(scratch))) for rank in range(tp)]


_MP_RANK = re.compile(r"mp_rank_(\d+)")


def checkpoint_tensor_parallel(tag_dir: Path) -> int:
    """The tensor-parallel size a DeepSpeed checkpoint folder was saved with: DeepSpeed names every file with
    its `mp_rank_NN` (the tensor-parallel rank under AutoTP)."""
    ranks = {int(m.group(1)) for path in Path(tag_dir).glob("*_states.pt") if (m := _MP_RANK.search(path.name))}
    if not ranks:
        raise FileNotFoundError(f"{tag_dir} holds no DeepSpeed model states (mp_rank_00_model_states.pt)")
    return max(ranks) + 1


def _tp_rank_view(tag_dir: Path, tp_rank: int, scratch: Path) -> Path:
    """A folder in which tensor-parallel rank `tp_rank`'s files of `tag_dir` look like a checkpoint without
    tensor parallelism (named mp_rank_00, linked, not copied): DeepSpeed's zero_to_fp32 reads mp_rank_00 only."""
    view = scratch / f"tp{tp_rank}" / tag_dir.name
    view.mkdir(parents=True)
    rank_name = f"mp_rank_{tp_rank:02d}"
    for path in tag_dir.glob(f"*{rank_name}*_states.pt"):
        (view / path.name.replace(rank_name, "mp_rank_00")).symlink_to(path.resolve())
    return view


def _fp32_weights(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The fp32 weights of a checkpoint folder without tensor parallelism, of any ZeRO stage."""
    if any(tag_dir.glob("*optim_states.pt")) and any(tag_dir.glob("zero_pp_rank_*")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            with forced_weights_only(DEEPSPEED_GLOBALS):
                state = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
        except pickle.UnpicklingError as err:  # torch refused a file DeepSpeed's reader opened: it does not say which
            raise UnsafeFile(tag_dir, refused_by_torch(err)) from None
    else:
        model_file = tag_dir / "mp_rank_00_model_states.pt"
        if not model_file.exists():
            raise FileNotFoundError(f"{tag_dir} holds no DeepSpeed model states (mp_rank_00_model_states.pt)")
        state = load_plain(model_file, DEEPSPEED_GLOBALS)["module"]
    return {name: tensor.detach().float() for name, tensor in state.items()}
