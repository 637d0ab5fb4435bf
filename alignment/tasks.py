"""Tasks this project adds to reasoning-gym's, registered under their names so that `rg:<name>:<options>` works
wherever an rg: task does (SFT's worked solutions, RL, evaluation, held-out splits by seed).

`repeated_addition` (issue 63): "Start at 37 and add 7 to it 14 times." The question stays the same size however
long the chain is, so a longer chain tests thinking past a budget, not reading a longer question (on
basic_arithmetic sums, SmolLM2-135M's chains broke at finding the k-th of 30 numbers in the question, whatever
the budget: docs/results.md). Worked solution (`--worked_style counted`): ` #1 37 + 7 = 44. #2 44 + 7 = 51.`; the
count to stop at is in the question, which every Delethink chunk sees.

Held out by construction: each (start, step) pair falls in one of two halves by a hash of the pair (salted with 63,
not the dataset's seed), so an evaluation on `held_out=true` never sees a question trained on `held_out=false`,
whatever the seeds and ranges, and both halves hold every kind of addition. (A first split by the parity of start + step did not: training
then never added an even step to an odd total, and the held-out questions that do scored 0.61 against 1.00.)

`add_until` (issue 63, the next recipe): "Start at 137 and add 7 until the result is more than 180." On
repeated_addition SmolLM2-135M, fine-tuned on 1-5 additions and RL-trained on 7, stopped after two additions when
asked for 29 and mostly after 4-9 when asked for 14 (docs/results.md): counts it never saw. Here the rule to stop is
the same at every length, a comparison of the total with the question's bound, written out in each step
(` 137 + 7 = 144 < 180.` ... ` 179 + 7 = 186 > 180.`), and no total equals the bound; every total stays under `max_total`
whatever the length, so a long chain adds the same kind of numbers as a short one. Held out as repeated_addition, by
the (start, step) pairs.
"""

from dataclasses import dataclass
from random import Random

from reasoning_gym.dataset import ProceduralDataset
from reasoning_gym.factory import DATASETS, register_dataset

from alignment.seeds import derive_seed

QUESTION = "Start at {start} and add {step} to it {times} times. What is the result?"
UNTIL = "Start at {start} and add {step} until the result is more than {bound}. What is the result?"
HALVES_SEED = 63  # salts the hash that puts each (start, step) pair in the training or the held-out half


def is_held_out(pair: tuple[int, int]) -> bool:
    """Whether a (start, step) pair is in the held-out half: a hash of the pair alone, so a pair's half does
    not depend on which other pairs a config's ranges produce (a shuffle of the list did: with max_start=120,
    32 of 100 "held-out" questions had been trained on with the defaults)."""
    return derive_seed(HALVES_SEED, *pair) % 2 == 1


@dataclass
class RepeatedAdditionConfig:
    min_times: int = 2
    max_times: int = 6
    min_start: int = 10
    max_start: int = 99
    min_step: int = 2
    max_step: int = 9
    held_out: bool = False
    seed: int | None = None
    size: int = 500

    def validate(self):
        assert 1 <= self.min_times <= self.max_times, "need 1 <= min_times <= max_times"
        assert 0 <= self.min_start <= self.max_start, "need 0 <= min_start <= max_start"
        assert 1 <= self.min_step <= self.max_step, "need 1 <= min_step <= max_step"
        assert self.max_start > self.min_start or self.max_step > self.min_step, \
            "the start or the step must have two values (half the pairs are held out)"


class RepeatedAdditionDataset(ProceduralDataset):
    """Row i: the i-th (start, step) pair of the config's half in an order shuffled by the dataset's seed (no pair repeats
    before all have come: 360 with the defaults), and a count of additions drawn from `seed + i`."""

    def __init__(self, config: RepeatedAdditionConfig):
        super().__init__(config=config, seed=config.seed, size=config.size)
        c = config
        pairs = [(start, step) for start in range(c.min_start, c.max_start + 1) for step in range(c.min_step, c.max_step + 1)]
        self.pairs = [pair for pair in pairs if is_held_out(pair) == c.held_out and self.keeps(pair)]
        assert self.pairs, "no (start, step) pair of these ranges falls in this half: widen the start or step range"
        Random(self.seed).shuffle(self.pairs)

    def keeps(self, pair: tuple[int, int]) -> bool:
        return True

    def __getitem__(self, idx: int) -> dict:
        start, step = self.pairs[idx % len(self.pairs)]
        times = Random(self.seed + idx).randint(self.config.min_times, self.config.max_times)
        return {"question": QUESTION.format(start=start, step=step, times=times), "answer": str(start + step * times),
                "metadata": {"start": start, "step": step, "times": times}}


if "repeated_addition" not in DATASETS:
    register_dataset("repeated_addition", RepeatedAdditionDataset, RepeatedAdditionConfig)


@dataclass
class AddUntilConfig(RepeatedAdditionConfig):
    min_start: int = 100
    max_start: int = 699
    max_total: int = 799  # no total passes it: a pair is drawn only if its chain of max_times stays under it

    def validate(self):
        assert 1 <= self.min_times <= self.max_times, "need 1 <= min_times <= max_times"
        assert 2 <= self.min_step <= self.max_step, "need 2 <= min_step <= max_step (a bound between two totals)"
        assert 0 <= self.min_start < self.max_start, "need 0 <= min_start < max_start"
        assert self.min_start + self.max_times * self.max_step <= self.max_total, \
            "max_total is too small for max_times additions of max_step from min_start"


class AddUntilDataset(RepeatedAdditionDataset):
    """Row i: the i-th pair of the config's half (shuffled by the dataset's seed) whose chain of max_times stays
    under max_total, a count of additions drawn from `seed + i` and a bound strictly between the last two totals."""

    def keeps(self, pair: tuple[int, int]) -> bool:
        start, step = pair
        return start + self.config.max_times * step <= self.config.max_total

    def __getitem__(self, idx: int) -> dict:
        start, step = self.pairs[idx % len(self.pairs)]
        draw = Random(self.seed + idx)
        times = draw.randint(self.config.min_times, self.config.max_times)
        bound = start + (times - 1) * step + draw.randint(1, step - 1)
        return {"question": UNTIL.format(start=start, step=step, bound=bound), "answer": str(start + step * times),
                "metadata": {"start": start, "step": step, "bound": bound, "times": times}}


if "add_until" not in DATASETS:
    register_dataset("add_until", AddUntilDataset, AddUntilConfig)
