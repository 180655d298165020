"""The gateway tests' fixtures: one in-process `shinkai serve` (HTTP + gRPC on random loopback ports) for the
whole package, a reference `LLM`, and per module a gRPC client, an `openai` client and the forcing engine over
that server. After the package, the server drains and its engine's pools must be whole."""

import openai
import pytest

from services.client import ShinkaiClient
from services.engine import LLM
from tests.services.gateway.forcing import forcing_engine
from tests.services.gateway.support import own_server


# Both engines in batch-invariant mode (docs/batch-invariance.md): the server batches a request with whatever
# else is in flight, LLM.generate runs it alone, and in this mode that cannot move a bit, so texts and
# logprobs compare under ==.
@pytest.fixture(scope="package")
def served():
    with own_server(
        max_queued=300, drain_timeout_s=10, engine_args={"max_num_seqs": 32, "batch_invariant": True}
    ) as thread:
        yield thread


@pytest.fixture(scope="package")
def reference_llm():
    """A second tiny model with the same weights, driven only by LLM.generate."""
    return LLM("tiny", max_num_seqs=32, batch_invariant=True)


@pytest.fixture(scope="module")
def grpc_client(served):
    """The Python shinkai.v1 client of the served gateway."""
    with ShinkaiClient(served.grpc_target, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def openai_client(served):
    """The unmodified `openai` client of the served gateway's OpenAI API."""
    return openai.OpenAI(base_url=served.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def forced(served):
    """The served frontend's engine wrapped for the module, so a test can force the model's output text
    (tests/services/gateway/forcing.py)."""
    with forcing_engine(served.server.frontend) as engine:
        yield engine
