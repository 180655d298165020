"""The readiness probe: one real one-token generation through the whole path (engine, worker, and the
detokenizer), bounded in time. ``GET /ready`` answers 200 only when it produced a token.

The prompt is the BOS token alone, greedy, so the probe never depends on the tokenizer's encode path or on
randomness; it is counted in the request metrics under endpoint "probe" like any other request.
"""

from __future__ import annotations

import asyncio

from services.engine.sampling_params import SamplingParams
from services.gateway.errors import ApiError
from services.gateway.frontend import Frontend, GenerateArgs

PROBE_TIMEOUT_S = 10.0


async def probe(frontend: Frontend, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when a one-token generation finished with a token; else why it did not."""
    args = GenerateArgs(
        model=None,
        prompt_token_ids=[frontend.info.bos_token_id],
        endpoint="probe",
        params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    )

    async def run() -> str | None:
        generation = await frontend.start(args)
        try:
            async for piece in generation:
                if piece.delta.finish_reason is not None:
                    if piece.delta.finish_reason == "length" and piece.delta.num_output_tokens == 1:
                        return None
                    return f"the probe generation ended with {piece.delta.finish_reason!r}"
            return "the probe generation ended without a final message"
        finally:
            generation.close()

    try:
        return await asyncio.wait_for(run(), timeout_s)
    except ApiError as err:
        return f"the probe generation was refused: {err.message}"
    except asyncio.TimeoutError:
        return f"the probe generation took over {timeout_s:.0f} s"
    except Exception as err:  # a probe never raises: any failure is "not ready"
        return f"the probe generation failed: {type(err).__name__}: {err}"
