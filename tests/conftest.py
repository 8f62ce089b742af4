"""Test-wide environment: CPU DeepSpeed, offline W&B and Hugging Face, no network at run time."""
import os

import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Inductor compiles its kernels in a pool of one process per core, each importing torch (~9 CPU-s a compiling
# process, measured with a cold cache). Here the cores are already the workers' and their ranks': compiling in the
# process itself does the same work without the pool. Read when torch._inductor.config is first imported.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Under pytest-xdist (./ayumi test runs one worker per core) each worker gets a temp folder of its own, kept
# between runs, and so its own inductor cache (torch keeps it in the temp folder, keyed by ISA inside:
# pretrain/model/inductor_cache.py). Two workers compiling the same kernel into one cache at once were seen
# to load each other's half-written .so ("file too short").
_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker:
    import tempfile

    _folder = os.path.join(tempfile.gettempdir(), f"ayumi-tests-{_worker}")
    os.makedirs(_folder, exist_ok=True)
    os.environ["TMPDIR"] = _folder
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    # The tests that compute in the worker itself share the cores with the other workers (and their jobs' ranks,
    # one thread each): more threads than that share only spin in OpenMP's barriers.
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, _workers)))

# Tests that compile in their own process (torch.compile on a function, not through the product's model.compile,
# which keys the cache itself) get an inductor cache folder keyed by the CPU instruction-set setting too: torch's
# key leaves it out, so a native run's kernels were served to a run as an AVX2-only CPU in the same temp folder,
# and one segfaulted (pretrain/model/inductor_cache.py says why). On one machine the setting is these variables:
# keyed by them alone, since the product's isa_folder_name imports inductor and probes the CPU (~6 s a worker).
# Each worker's folder is its own (set here in the worker: xdist's controller imports this file too, and its
# environment is the workers').
_TESTS_CACHE = "torchinductor-tests-"
if os.path.basename(os.environ.get("TORCHINDUCTOR_CACHE_DIR", _TESTS_CACHE)).startswith(_TESTS_CACHE):
    import hashlib
    import tempfile

    from pretrain.model.inductor_cache import ISA_VARIABLES

    _setting = "|".join(f"{name}={os.environ.get(name, '')}" for name in ISA_VARIABLES) + f"|torch={torch.__version__}"
    _key = hashlib.sha256(_setting.encode()).hexdigest()[:10]
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"{_TESTS_CACHE}{_key}")

# The files that take minutes go first, so that with several workers none of them starts last and leaves the
# others idle (xdist hands out whole files in collection order: ./ayumi passes --no-loadscope-reorder, since xdist
# would otherwise order the files by how many tests they hold). Slowest first: each file's test time in the suite
# run as an AVX2-only CPU of 2026-11-29 (the offload test's file is placed by its first run, when DeepSpeed's CPU
# Adam is built: 190 s, against 69 s later).
HEAVY_FILES = (
    "tests/bench/test_gpu_acceptance_smoke.py",
    "tests/pretrain/engine/test_grad_accum_cpu.py",
    "tests/demo/test_demo_spike.py",
    "tests/pretrain/test_train_cpu.py",
    "tests/pretrain/stability/test_stability_cpu.py",
    "tests/pretrain/plan/test_memory.py",
    "tests/pretrain/model/test_inductor_cache.py",
    "tests/pretrain/job/test_signals.py",
    "tests/pretrain/checkpoint/test_checkpoint_async_cpu.py",
    "tests/pretrain/model/test_compile.py",
    "tests/pretrain/test_resume_contract.py",
    "tests/pretrain/engine/test_tensor_parallel_cpu.py",
    "tests/pretrain/engine/test_precision.py",
    "tests/pretrain/checkpoint/test_checkpoint_paths_cpu.py",
    "tests/pretrain/checkpoint/test_checkpoint_payloads_cpu.py",
    "tests/pretrain/test_data_integrity.py",
    "tests/pretrain/model/test_init_from_hf.py",
    "tests/pretrain/test_downstream_cpu.py",
    "tests/pretrain/checkpoint/test_run_folder_data_cpu.py",
    "tests/pretrain/test_curriculum_cpu.py",
    "tests/pretrain/job/test_hang_watchdog.py",
    "tests/pretrain/checkpoint/test_checkpoint_trust_cpu.py",
    "tests/test_readme_own_corpus.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(HEAVY_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(HEAVY_FILES)))  # stable: the rest keep order
