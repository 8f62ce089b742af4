"""Debian packages for the demo's sources: `apt-get download` + `dpkg-deb -x`, never installed.

The .debs are kept in a cache (`debs/`) and unpacked beside them (`unpacked/NAME_VERSION_ARCH/`,
paths below mirror the installed ones), so a rebuild needs no network. Which packages, and what
is read from them, is the source modules' business (demo.manpages, demo.austen, demo.pari).

`install` is the one place that changes the machine: demo.manpages uses it, as root only, to get
groff when it is missing.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from demo.base import DemoCorpusError, Progress, SourceUnavailable


@dataclass
class Package:
    """One unpacked Debian package."""

    name: str
    version: str
    deb: Path
    """The downloaded .deb (kept in the cache so a rebuild needs no network)."""
    root: Path
    """Where `dpkg-deb -x` unpacked it (paths below it mirror the installed ones)."""

    @property
    def copyright(self) -> Path:
        return self.root / "usr/share/doc" / self.name / "copyright"


def fetch_packages(names: Iterable[str], cache_dir: Path, progress: Progress = print) -> dict[str, Package]:
    """Download (once) and unpack the named packages under cache_dir; SourceUnavailable says why not."""
    names = list(names)
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise SourceUnavailable(
                f"`{tool}` is not on PATH: this does not look like Debian/Ubuntu, so the demo's Japanese, "
                f"English and math text ({', '.join(names)}) cannot be downloaded from Debian's archive."
            )
    debs_dir = cache_dir / "debs"
    debs_dir.mkdir(parents=True, exist_ok=True)
    missing = [name for name in names if _cached_deb(debs_dir, name) is None]
    if missing:
        progress(f"downloading Debian packages {' '.join(missing)} (apt-get download) ...")
        _apt_download(missing, debs_dir)
    return {name: _unpack(_cached_deb(debs_dir, name), name, cache_dir / "unpacked") for name in names}


def _cached_deb(debs_dir: Path, name: str) -> Path | None:
    """The newest NAME_*.deb already downloaded, if any."""
    debs = sorted(debs_dir.glob(f"{name}_*.deb"), key=lambda path: path.stat().st_mtime)
    return debs[-1] if debs else None


def _apt_download(names: list[str], debs_dir: Path) -> None:
    """`apt-get download` into debs_dir; on failure refresh the package lists once (as root) and retry."""
    result = _run(["apt-get", "download", *names], cwd=debs_dir)
    if result.returncode != 0 and os.geteuid() == 0:
        # The usual cause is empty or stale package lists (fresh containers ship without them).
        _run(["apt-get", "update"], cwd=debs_dir)
        result = _run(["apt-get", "download", *names], cwd=debs_dir)
    if result.returncode != 0:
        detail = _last_lines(result.stdout + result.stderr)
        fix = "check the network/proxy to the Debian mirror" if os.geteuid() == 0 else "run `sudo apt-get update` first"
        raise SourceUnavailable(f"`apt-get download {' '.join(names)}` failed ({fix}):\n{detail}")


def _unpack(deb: Path, name: str, unpacked_dir: Path) -> Package:
    version = _run_checked(["dpkg-deb", "-f", str(deb), "Version"]).strip()
    root = unpacked_dir / deb.stem
    if not root.is_dir():
        unpacked_dir.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{deb.stem}.", dir=unpacked_dir))
        _run_checked(["dpkg-deb", "-x", str(deb), str(partial)])
        partial.rename(root)
    return Package(name=name, version=version, deb=deb, root=root)


def _run(cmd: list[str], cwd: Path | None = None, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, input=stdin, capture_output=True, text=stdin is None)


def _run_checked(cmd: list[str]) -> str:
    result = _run(cmd)
    if result.returncode != 0:
        raise DemoCorpusError(f"`{' '.join(cmd)}` failed (exit {result.returncode}):\n{_last_lines(result.stderr)}")
    return result.stdout


def _last_lines(text: str, count: int = 6) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join("  " + line for line in lines[-count:])


def can_install() -> bool:
    """apt-get is here and this process is root: a missing tool can be installed."""
    return shutil.which("apt-get") is not None and os.geteuid() == 0


def install(name: str) -> None:
    """`apt-get install -y --no-install-recommends NAME`; SourceUnavailable with apt's last lines if it fails."""
    result = _run(["apt-get", "install", "-y", "--no-install-recommends", name])
    if result.returncode != 0:
        raise SourceUnavailable(f"installing {name} failed:\n{_last_lines(result.stdout + result.stderr)}")
