"""One finding: its level and its record (code, message, the usual remedy). Below every module
that produces findings, so the box-wide ones (findings) and the PCIe ones (pcie_findings) share it
without importing each other."""

from __future__ import annotations

from typing import Any

FAIL, WARN, INFO = "FAIL", "WARN", "INFO"


def finding(level: str, code: str, message: str, remedy: str | None = None) -> dict[str, Any]:
    return {"level": level, "code": code, "message": message, "remedy": remedy}
