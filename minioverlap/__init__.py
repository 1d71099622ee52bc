"""minioverlap: a small LLM inference engine that teaches overlap scheduling, chapter by chapter."""

from minioverlap.llm import LLM, RequestOutput
from minioverlap.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
