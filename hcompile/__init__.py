"""What users touch: the decorator and ``compile()``, the capture backend, config presets and the
``hcompile`` command line. May import every other package."""

from hcompile.api import CompiledModel, compile, hydraulis
from hcompile.capture import CaptureError, Captured, capture

__all__ = ["CaptureError", "Captured", "CompiledModel", "capture", "compile", "hydraulis"]
