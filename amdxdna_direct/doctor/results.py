"""What a check returns, and the statuses it may have (docs/doctor.md 1)."""

from __future__ import annotations

import errno
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

PASS, INFO, WARN, FAIL, SKIP = "pass", "info", "warn", "fail", "skip"
_SEVERITY = {SKIP: 0, PASS: 1, INFO: 2, WARN: 3, FAIL: 4}

FIX_UPDATE_DRIVER = ("use Linux >= 6.18 (feature level 0.1+) or the amd/xdna-driver DKMS module; check with "
                     "`modinfo amdxdna`")


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check: ``status`` is one of PASS, INFO, WARN, FAIL, SKIP; ``fix`` says what to do.

    ``findings`` is the kernel-log check's list of findings (each a dict, :meth:`Finding.to_dict`); empty
    for the other checks.
    """

    name: str
    status: str
    detail: str
    fix: str = ""
    findings: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The result as a plain dict (for ``--json``)."""
        result = asdict(self)
        result["findings"] = list(self.findings)
        return result


def _errno_name(err: int | None) -> str:
    """``"ENOENT"`` for an errno value; its number when it has no name, ``"None"`` for an OSError without one."""
    return str(err) if err is None else errno.errorcode.get(err, str(err))


def worst(results: Iterable[CheckResult]) -> str:
    """The most severe status among ``results`` (FAIL > WARN > INFO > PASS/SKIP)."""
    seen = {r.status for r in results}
    return FAIL if FAIL in seen else WARN if WARN in seen else INFO if INFO in seen else PASS
