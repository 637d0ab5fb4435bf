"""Where each RL step's batch comes from: sampled when the step asks for it (`--async_steps 0`, the
synchronous loop), or one step ahead, in a background thread, while the policy trains (`--async_steps 1`).

One-step-off rollouts (verl's one_step_off_policy recipe; AReaL, Fu et al. 2025). Version v is the policy
after v RL steps. While step t trains on its batch, the sampler generates step t+1's batch with version t,
the weights the policy had when step t began. New weights are pushed between batches, never during one.
So the batch trained at step t >= 1 was sampled by version t-1, and the step's metrics log `policy_lag` 1
(0 for the first step, which has nothing in flight to train on and samples its own batch first).

The objective is AReaL's decoupled PPO objective, with three policies:
- the behaviour policy is the sampler, and every sampled token carries its log-prob;
- the proximal policy is the one the PPO ratio is taken against. Here it is the learner at the start of
  step t (version t): the old log-probs, computed before any update exactly as in the synchronous loop;
- the behaviour correction pi_prox / pi_behav is the rollout-correction weight (`--rollout_is`,
  truncated or masked at C; args.check refuses `--rollout_is none` with `--async_steps 1`).
The same correction covers the numeric gap between sampler and learner (another kernel, bf16), so one
weight does both jobs.

Determinism: a batch is a function of the seed, the step and the weights that sampled it (every request
has its own seed, see sampling.py), not of thread timing. Only the background thread touches the sampler
and the grader while a batch is in flight; evaluation and checkpoints wait for it first. A checkpoint
taken after step t holds step t+1's batch, already sampled by version t, so `--resume` trains on what the
uninterrupted run would have. (A finished run resumed with a larger `--n_steps` has no batch in flight:
its next batch is sampled by the current weights, with lag 0.)

The background thread is a daemon: Ctrl-C does not wait for the batch in flight.
"""

import threading
import time

from tqdm.auto import tqdm

from alignment.experience import Batch

REPORT_EVERY = 300.0  # seconds between notes while the loop waits for a batch in flight


class RolloutSource:
    """Hands the loop each step's batch. `collect(step, drawn) -> (Batch, drawn)` samples and scores one
    step's batch from position `drawn` of the question stream; `push()` brings the sampler up to the
    policy's current weights and returns the seconds it took."""

    def __init__(self, async_steps: int, n_steps: int, collect, push, drawn: int = 0, in_flight: Batch | None = None):
        self.ahead, self.n_steps, self.collect, self.push = async_steps, n_steps, collect, push
        self.drawn = drawn  # stream position after the last batch collected (in flight included)
        self.ready = in_flight  # a finished batch that no step has taken yet
        self.thread, self.error = None, None

    def take(self, step: int) -> Batch:
        """Step `step`'s batch. With one batch in flight: wait for it (or sample it now if there is none),
        push the weights of this step's start, and start sampling the next step's batch with them."""
        if not self.ahead:
            return self._collect(step, version=step)  # the sampler holds the current weights
        start = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - start
        batch = self.ready if self.ready is not None else self._collect(step, version=step)
        self.ready = None
        batch.seconds["wait"] = waited  # the loop's time blocked on the batch in flight
        if step + 1 < self.n_steps:
            batch.seconds["sync"] = self.push()
            self.thread = threading.Thread(target=self._in_background, args=(step + 1, step), daemon=True)
            self.thread.start()
        return batch

    def after_update(self) -> float:
        """Synchronous: push the new weights now (seconds). One step ahead: nothing; the push waits until
        the batch in flight is done (see take)."""
        return 0.0 if self.ahead else self.push()

    def wait(self):
        """Wait for the batch in flight, if any, and keep it for the step that takes it."""
        if self.thread is not None:
            start = time.perf_counter()
            self.thread.join(REPORT_EVERY)
            while self.thread.is_alive():  # a hung sampler is not silent
                tqdm.write(f"[train_rl] still waiting for the batch in flight after {time.perf_counter() - start:.0f} s")
                self.thread.join(REPORT_EVERY)
            self.thread = None
            if self.error is not None:
                error, self.error = self.error, None
                raise error

    def state(self) -> dict:
        """What a checkpoint needs to go on exactly: the stream position and the batch in flight (waited for)."""
        self.wait()
        return {"questions_drawn": self.drawn, "in_flight": self.ready}

    def _collect(self, step: int, version: int) -> Batch:
        batch, self.drawn = self.collect(step, self.drawn)
        batch.policy_version = version
        return batch

    def _in_background(self, step: int, version: int):
        try:
            self.ready = self._collect(step, version)
        except BaseException as error:  # raised again in the loop's thread by wait()
            self.error = error
