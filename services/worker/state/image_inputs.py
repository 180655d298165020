"""Image embeddings per request, and the rows of one step that take them (the embedding step).

A request's prompt holds its images' placeholder spans; ``put`` stores, per request, the span
embeddings of every placeholder position in prompt order ([P, D], the multimodal service's spans
concatenated). At a step, a row at one of those prompt positions takes the embedding of its
request's k-th placeholder, k = how many placeholders precede its position in the prompt: so a
prefill chunk that starts or ends inside a span takes exactly its part, and a recomputed (preempted)
prompt takes the same rows again. Image rows are found by prompt position, never by id alone: a
placeholder id anywhere else (sampled by a random model) is a text row. ``release`` drops a request's
embeddings when it ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RequestImages:
    positions: torch.Tensor  # long [P]: the prompt positions holding the placeholder, ascending
    rows: torch.Tensor  # [P, D]: their embeddings, same order


class ImageInputs:
    def __init__(self, image_token_id: int) -> None:
        self.image_token_id = image_token_id
        self._requests: dict[str, RequestImages] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        """The number of requests whose embeddings are held (each released with its request)."""
        return len(self._requests)

    def put(self, request_id: str, prompt_token_ids: list[int], rows: torch.Tensor) -> None:
        """Stores ``rows`` [P, D] for the P placeholders of ``prompt_token_ids``; ValueError if P differs."""
        positions = torch.tensor(
            [i for i, t in enumerate(prompt_token_ids) if t == self.image_token_id], dtype=torch.long
        )
        if rows.ndim != 2 or rows.shape[0] != positions.numel():
            raise ValueError(
                f"request {request_id!r} has {positions.numel()} image placeholder positions but "
                f"{tuple(rows.shape)} image embedding rows"
            )
        self._requests[request_id] = RequestImages(positions, rows)

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def step_rows(
        self, request_ids: list[str], input_ids: torch.Tensor, positions: torch.Tensor, row_requests: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """For a step's rows (input ids, positions, request index of each, all [R]) → (image mask [R] bool,
        the image rows' embeddings [n, D] in row order), or (None, None) when no row is an image position.
        A step none of whose requests holds images returns before touching the tensors, so a text step
        never reads the device (async decode steps must not synchronise the stream)."""
        if not any(request_id in self._requests for request_id in request_ids):
            return None, None
        input_ids, positions, row_requests = input_ids.cpu(), positions.cpu(), row_requests.cpu()
        image = torch.zeros_like(input_ids, dtype=torch.bool)
        out = []
        for row in torch.nonzero(input_ids == self.image_token_id).flatten().tolist():
            entry = self._requests.get(request_ids[int(row_requests[row])])
            if entry is None:
                continue
            position = int(positions[row])
            k = int(torch.searchsorted(entry.positions, position))
            if k < entry.positions.numel() and int(entry.positions[k]) == position:
                image[row] = True
                out.append(entry.rows[k])
        return (image, torch.stack(out)) if out else (None, None)
