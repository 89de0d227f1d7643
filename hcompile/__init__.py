"""What users touch: ``compile()`` (a ``CompiledModel``) and the ``@hydraulis`` decorator, training through
``CompiledModel.trainer(...)`` or ``Trainer(compiled, TrainOptions(...))``, real data (``hcompile.data``),
meta-device construction and initialisation for large models, capture, and the ``hcompile`` command line.
``hcompile.tools`` holds what is not the user API (profiling, the planner simulation, local jobs). May import
every other package."""

from hcompile.api import CompiledModel, compile, hydraulis
from hcompile.capture import Captured, CaptureError, capture
from hcompile.export import ExportError
from hcompile.init import empty_init, normal_init
from hcompile.train import Trainer, TrainOptions
from hcompile.verify import LoweringError
from runtime.batch_check import CollectiveCallError
from runtime.executor import NonFiniteError

__all__ = ["CaptureError", "Captured", "CollectiveCallError", "CompiledModel", "ExportError", "LoweringError",
           "NonFiniteError", "TrainOptions", "Trainer", "capture", "compile", "empty_init", "hydraulis",
           "normal_init"]
