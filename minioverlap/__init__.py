"""minioverlap: a small LLM inference engine that teaches overlap scheduling, chapter by chapter."""

# >>> ch15: first of all: without a GPU, Triton's interpreter, before anything imports triton
import minioverlap.kernels  # noqa: F401
# <<< ch15
from minioverlap.llm import LLM, RequestOutput
from minioverlap.model.loader import CheckpointError
from minioverlap.sampling_params import SamplingParams
# >>> ch04: the scheduler's own check
from minioverlap.scheduler.checks import IntegrityError
# <<< ch04
# >>> ch08: the hazard checker
from minioverlap.device.hazard import HazardError
# <<< ch08

__all__ = [
    "LLM",
    "RequestOutput",
    "SamplingParams",
    # the errors a caller may catch
    "CheckpointError",
    # >>> ch04: the scheduler's own check
    "IntegrityError",
    # <<< ch04
    # >>> ch08: the hazard checker
    "HazardError",
    # <<< ch08
]
