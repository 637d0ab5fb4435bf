"""Seeds derived from a run's seed: one pure function, used for sampling requests, data orders and the
procedural datasets' rows (no torch import, so the data code can use it)."""

import hashlib


def derive_seed(*parts) -> int:
    """A 63-bit seed that is a pure function of `parts` (ints or strings), and unrelated for any two
    different tuples: (run seed, step, round) -> a step's base seed; (base, prompt key, child) -> a
    request's seed. A hash, not base + k, so that nearby tuples do not share random streams."""
    digest = hashlib.blake2b(repr(tuple(parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
