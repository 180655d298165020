"""The engine: the step loop over the scheduler and a worker, and the offline `LLM` API."""

from services.engine.config import EngineConfig
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # `LLM` is imported on first use: it needs the Rust scheduler, while the command line's parsers import
    # this package (services/engine/device.py) and must work before the extension is built.
    if name == "LLM":
        from services.engine.llm import LLM

        return LLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
