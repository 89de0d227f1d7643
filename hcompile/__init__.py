"""What users touch: the decorator and ``compile()``, the capture backend, meta-device construction and
initialisation for large models, config presets and the ``hcompile`` command line. May import every other
package."""

from hcompile.api import CompiledModel, compile, hydraulis
from hcompile.capture import CaptureError, Captured, capture
from hcompile.init import empty_init, normal_init

__all__ = ["CaptureError", "Captured", "CompiledModel", "capture", "compile", "empty_init", "hydraulis",
           "normal_init"]
