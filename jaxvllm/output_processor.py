"""Output processing: a step's appended tokens in, `RequestOutput`s out (vLLM's
`OutputProcessor`).

It detokenizes incrementally (every step for requests with stop strings, so that they
stop in time; otherwise only when the text is read, so `generate` decodes each completion
once), turns the step's logprob arrays into vLLM's logprob dicts, and assembles each
parent's output as its `output_kind` asks: everything so far (CUMULATIVE), what is new
(DELTA), or one output at the end (FINAL_ONLY). It never touches the scheduler: a stop
string it finds is handed back for the engine to finish the request.
"""

from __future__ import annotations

import numpy as np

from jaxvllm.logprobs import Logprob
from jaxvllm.outputs import CompletionOutput, RequestOutput
from jaxvllm.request import ParentRequest, Request, ScheduledRequest
from jaxvllm.sampling_params import RequestOutputKind


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}  # a token's text alone, for logprobs
        # What the outputs built since the last `commit` hold, (parent, completion, (tokens,
        # characters) or None for a final output): sent once the caller has the outputs.
        self._sending: list[tuple[ParentRequest, int, tuple[int, int] | None]] = []

    def commit(self) -> None:
        """The outputs built since the last commit reached the caller: DELTA streams go on
        after them, and the completions they finished are reported."""
        for parent, i, sent in self._sending:
            if sent is None:
                parent.finals_sent.add(i)
            else:
                parent.sent[i] = sent
        self._sending.clear()

    def rollback(self) -> None:
        """The outputs built since the last commit were lost (a failed step): the next
        outputs send their tokens and text again."""
        self._sending.clear()

    def detokenize(self, request: Request) -> str | None:
        """Bring the text up to date with the tokens. Returns the stop string that ends the
        completion there (the request's finish reason is then "stop"), else None."""
        new = request.output_token_ids_from(request.num_detokenized)
        if request.detokenizer is None or not new:
            return None
        # As vLLM's, the text leaves out the EOS or stop token id that ended the completion
        # (unless include_stop_str_in_output).
        skipped = int(request.stopped_on_token and not request.params.include_stop_str_in_output)
        request.num_detokenized += skipped
        new = new[: len(new) - skipped]
        if not new:
            return None
        # Several new tokens (accepted drafts): one at a time, so that a stop string ends the
        # completion at the token that completes it and the tokens after it are dropped.
        parts = [new] if len(new) == 1 or not request.has_stop_strings else [[token] for token in new]
        for i, part in enumerate(parts):
            request.num_detokenized += len(part)
            # vLLM looks for stop strings only once more than min_tokens tokens exist.
            stop = request.detokenizer.update(part, check_stop=request.num_detokenized - skipped
                                              > request.min_tokens)
            if stop is not None:
                dropped = len(parts) - 1 - i + skipped
                if dropped and request.logprobs is not None:  # (their logprobs, recorded already, go too)
                    for token, entry in zip(request.token_ids[-dropped:], request.logprobs[-dropped:]):
                        request.cumulative_logprob -= entry[token].logprob
                    del request.logprobs[-dropped:]
                del request.token_ids[len(request.token_ids) - dropped :]
                request.finish_reason, request.stop_reason = "stop", stop
                return stop
        return None

    def record_logprobs(self, scheduled: list[ScheduledRequest], result, updated: set[int],
                        appended: list[int] | None = None) -> None:
        """Append the step's sampled-token logprobs to the requests in `updated` (their ids)
        and fill the prompt logprobs it computed. `appended`: how many tokens each scheduled
        request got (speculative decoding: its accepted drafts too; default one)."""
        if result.logprobs is not None:
            lp = _as_lists(result.logprobs)
            for i, s in enumerate(scheduled):
                request = s.request
                if request.logprobs is None or id(request) not in updated:
                    continue
                count = 1 if appended is None else appended[i]
                first = i if result.logits_start is None else int(result.logits_start[i])
                for row, token in enumerate(request.token_ids[len(request.token_ids) - count :], start=first):
                    request.logprobs.append(self._logprob_dict(token, lp, row, request.num_logprobs,
                                                               request.params.detokenize))
                    request.cumulative_logprob += lp[0][row]
        if result.prompt_logprobs is not None:
            lp = _as_lists(result.prompt_logprobs)
            for row, (i, pos) in enumerate(result.prompt_positions):
                request = scheduled[i].request
                request.prompt_logprobs[pos] = self._logprob_dict(
                    request.prompt_token_ids[pos], lp, row, request.num_prompt_logprobs, request.params.detokenize)

    def _logprob_dict(self, token: int, lp: tuple[list, list, np.ndarray, np.ndarray], row: int, k: int,
                      detokenize: bool) -> dict[int, Logprob]:
        """vLLM's format: the chosen token first, then the top k (rank order); each token's
        text only when the request detokenizes (else None, as vLLM). As vLLM's, a chosen
        token among the top k takes its place's rank there (they differ only for a tie).
        `lp`: the step's logprob arrays, the chosen tokens' as lists (`_as_lists`)."""
        decode = self._token_text if detokenize and self.tokenizer is not None else lambda _: None
        token_logprob, token_rank, top_ids, top_logprobs = lp
        entry = {token: Logprob(token_logprob[row], token_rank[row], decode(token))}
        for j, (t, value) in enumerate(zip(top_ids[row, :k].tolist(), top_logprobs[row, :k].tolist())):
            entry[t] = Logprob(value, j + 1, decode(t))
        return entry

    def _token_text(self, token_id: int) -> str:
        """A token's text alone, cached: logprobs name up to max_logprobs + 1 tokens per row per step."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def step_outputs(self, updated: list[Request], parents: dict[str, ParentRequest]
                     ) -> tuple[list[RequestOutput], list[ParentRequest]]:
        """The outputs of a step's updated requests, as their parent's output_kind asks, and
        the parents that finished (the caller forgets them). As vLLM V1's: a streamed (not
        FINAL_ONLY) parent of n > 1 completions gives one output per updated completion,
        holding that completion alone; FINAL_ONLY gives all n at once, at the end."""
        outputs, finished, whole, last = [], {}, set(), {}
        for request in dict.fromkeys(updated):  # (each once)
            parent = parents.get(request.parent_id)
            if parent is None:
                continue
            streamed = parent.output_kind is not RequestOutputKind.FINAL_ONLY
            done = request.is_finished and parent.finished
            if streamed and len(parent.children) > 1:
                outputs.append(self.output(parent, only=parent.children.index(request)))
                if parent.request_id in last:  # (only its last output of the step says finished)
                    last[parent.request_id].finished = False
                last[parent.request_id] = outputs[-1]
            elif parent.request_id not in whole and (streamed or done):
                whole.add(parent.request_id)
                outputs.append(self.output(parent))
            if done:
                finished[parent.request_id] = parent
        return outputs, list(finished.values())

    def output(self, parent: ParentRequest, only: int | None = None) -> RequestOutput:
        """The parent's RequestOutput (of completion `only` alone, if given): everything so
        far, or (DELTA) what is new since the last one. Until it finishes, with stop
        strings, its text holds back as many characters as could start one (vLLM's stop
        buffer), so that no text is streamed that a stop string later takes back. DELTA
        sends the prompt logprobs once, with a completion's first output (later ones get [])."""
        delta = parent.output_kind == RequestOutputKind.DELTA
        lead = 0 if only is None else only  # (the completion whose prompt fields the output reports)
        first = parent.children[lead]
        prompt_logprobs = first.prompt_logprobs
        if delta and prompt_logprobs is not None and parent.sent[lead][0]:
            prompt_logprobs = []  # (sent with this completion's first output)
        completions = []
        for i in range(len(parent.children)) if only is None else (only,):
            child = parent.children[i]
            self.detokenize(child)
            detokenizer, logprobs = child.detokenizer, child.logprobs
            sent_tokens, sent_chars = parent.sent[i] if delta else (0, 0)
            tokens = child.output_token_ids_from(sent_tokens) if delta else child.output_token_ids
            text = ""
            if detokenizer is not None:
                end = detokenizer.length - (0 if child.is_finished else detokenizer.stop_buffer)
                # (DELTA: what is new alone, nothing before it copied)
                text = detokenizer.text_since(sent_chars) if delta else detokenizer.text
                text = text[: max(0, end - sent_chars)]
            if delta:
                logprobs = logprobs[sent_tokens:] if logprobs is not None else None
                self._sending.append((parent, i, (sent_tokens + len(tokens), sent_chars + len(text))))
            elif logprobs is not None:  # (a copy, as the tokens are: the request's own list grows on)
                logprobs = list(logprobs)
            if child.is_finished:
                self._sending.append((parent, i, None))
            completions.append(CompletionOutput(
                index=i,
                text=text,
                token_ids=tokens,
                cumulative_logprob=child.cumulative_logprob,
                logprobs=logprobs,
                finish_reason=child.finish_reason if child.is_finished else None,
                stop_reason=child.stop_reason,
                lora_request=parent.lora_request,
            ))
        return RequestOutput(
            request_id=parent.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=parent.finished,
            # (one completion: its own, as vLLM's; all n: the most, where vLLM's is the last to
            # finish's, an order it does not fix; 0 before the first admission, as vLLM's)
            num_cached_tokens=(first.num_cached_tokens or 0) if only is not None else
            max(c.num_cached_tokens or 0 for c in parent.children),
            metrics=first.metrics,
            prompt_logprobs=prompt_logprobs,
            lora_request=parent.lora_request,
        )


def _as_lists(lp) -> tuple[list, list, np.ndarray, np.ndarray]:
    """A step's logprob arrays, the chosen tokens' as Python lists: converted at once (numpy's
    scalars, read one at a time, cost several times more); the top ones are converted a row's
    first k at a time (a row that asks for the whole vocabulary would make every row's so)."""
    return lp.token_logprob.tolist(), lp.token_rank.tolist(), lp.top_ids, lp.top_logprobs
