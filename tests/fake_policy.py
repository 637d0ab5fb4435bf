"""A scripted fake policy for rollout-mode tests: the sampler interface with known outputs.

`FakePolicy(tokenizer, respond)` has `generate(prompt_token_ids, params) -> list[list[Completion]]` like
`alignment.sampling.HFSampler` and the same stopping semantics: a completion ends at `max_tokens`
("length"), at an EOS id (kept in token_ids, not in text; "stop"), or at the token that completes a stop
string (kept at the end of the text; "stop", stop_reason set); neither stop counts before `min_tokens`
tokens exist, and an EOS the script places earlier is skipped (HF masks EOS there, so it cannot be
sampled). `respond(prompt_ids, k)` returns the tokens the policy would emit for sample k of that prompt
if nothing stopped it; a script that runs out before any stop is an error, so tests say what they mean.
Every call is recorded in `calls` as (prompts, params) and its request keys in `keys`.

`ServingFakePolicy` also has `serve` (alignment.sampling.VLLMSampler's continuous batching, for TIR): its
requests complete one at a time, first in first out, so a trace's next round joins the queue behind the
others' current ones; each is recorded as a call of its own, ([prompt], params with n = 1), keys [key].

`continue_streams(streams_by_prompt)` builds a `respond` for Markovian (Delethink-style) tests: each
original prompt owns n fixed token streams; a prompt seen before gets stream k from the start, and any
other prompt continues the stream it ends in (longest match of the prompt's suffix against a stream
prefix), like a model that picks up from the tail of its carried-over reasoning.
"""

from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace

from alignment.sampling import Completion, Request, SamplingParams

Respond = Callable[[list[int], int], list[int]]  # (prompt ids, sample index) -> tokens it would emit


class FakePolicy:
    def __init__(self, tokenizer, respond: Respond, eos_ids: list[int] | None = None):
        self.tokenizer, self.respond = tokenizer, respond
        self.eos_ids = set(eos_ids if eos_ids is not None else [tokenizer.eos_token_id])
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []
        self.keys: list[list] = []

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 keys: list | None = None) -> list[list[Completion]]:
        prompts = [list(p) for p in prompt_token_ids]
        self.calls.append((prompts, params))
        self.keys.append(list(range(len(prompts))) if keys is None else list(keys))
        return [[self._complete(prompt, k, params) for k in range(params.n)] for prompt in prompts]

    def _complete(self, prompt: list[int], k: int, params: SamplingParams) -> Completion:
        ids: list[int] = []
        for token in self.respond(prompt, k):
            if len(ids) == params.max_tokens:
                break
            can_stop = len(ids) + 1 > params.min_tokens
            if token in self.eos_ids and not can_stop:
                continue
            ids.append(token)
            if token in self.eos_ids:
                return self._completion(ids, "stop", None)
            for stop in params.stop if can_stop else ():
                if self._decode(ids).count(stop) > self._decode(ids[:-1]).count(stop):
                    return self._completion(ids, "stop", stop)
        if len(ids) == params.max_tokens:
            return self._completion(ids, "length", None)
        raise ValueError(f"the script for sample {k} of prompt ...{prompt[-5:]} ran out after {len(ids)} tokens "
                         f"without EOS, a stop string or max_tokens={params.max_tokens}; make it longer")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _completion(self, ids: list[int], reason: str, stop: str | None) -> Completion:
        text = self._decode(ids)
        if stop is not None:  # the last token may run past the stop string; the text ends with it
            text = text[:text.rfind(stop) + len(stop)]
        return Completion(token_ids=ids, text=text, finish_reason=reason, stop_reason=stop)


class ServingFakePolicy(FakePolicy):
    def serve(self, requests: dict, follow) -> None:
        queue, waiting = deque(requests.items()), {}
        while queue or waiting:
            if queue:
                tag, request = queue.popleft()
                self.calls.append(([list(request.prompt_ids)], replace(request.params, n=1)))
                self.keys.append([request.key])
                events = [(tag, self._complete(list(request.prompt_ids), request.child, request.params))]
            else:
                wait(waiting.values(), return_when=FIRST_COMPLETED)
                events = [(tag, waiting.pop(tag)) for tag, future in list(waiting.items()) if future.done()]
            for tag, event in events:
                after = follow(tag, event)
                if isinstance(after, Request):
                    queue.append((tag, after))
                elif isinstance(after, Future):
                    waiting[tag] = after


def continue_streams(streams_by_prompt: dict[tuple[int, ...], list[list[int]]]) -> Respond:
    """A `respond` that starts stream k for a known prompt and otherwise continues the matching stream."""
    streams = [s for group in streams_by_prompt.values() for s in group]

    def respond(prompt: list[int], k: int) -> list[int]:
        if tuple(prompt) in streams_by_prompt:
            return streams_by_prompt[tuple(prompt)][k]
        best, where = 0, []
        for s, stream in enumerate(streams):
            for end in range(1, len(stream) + 1):
                length = 0
                while length < min(end, len(prompt)) and stream[end - 1 - length] == prompt[-1 - length]:
                    length += 1
                if length and length == best:
                    where.append((s, end))
                elif length > best:
                    best, where = length, [(s, end)]
        if len(where) != 1:
            raise ValueError(f"prompt ending ...{prompt[-5:]} continues {len(where) or 'no'} stream positions; "
                             "use streams whose carried-over tails are unique")
        s, end = where[0]
        return streams[s][end:]

    return respond
