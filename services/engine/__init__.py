"""The engine: the step loop over the scheduler and a worker, and the offline `LLM` API."""

from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]
