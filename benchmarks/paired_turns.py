"""Paired ratios of tau over the same turns, for the results folders' paired.py scripts: the ratio of
sum emitted / sum rounds of two rows over the turns both measured, and a bootstrap 95% interval over
turns (2,000 draws, random.Random(0)). A row is {turn key: (tokens emitted, rounds)}."""
import random


def paired(name: str, a: dict, b: dict, draws: int = 2000) -> float:
    """Print and return a's tau over b's on the same turns, with its interval."""
    keys = sorted(a)
    assert set(keys) == set(b), f"{name}: the rows measured other turns"

    def ratio(ks):
        return (sum(a[k][0] for k in ks) / sum(a[k][1] for k in ks)) / (sum(b[k][0] for k in ks) / sum(b[k][1] for k in ks))

    rnd = random.Random(0)
    sample = sorted(ratio([rnd.choice(keys) for _ in keys]) for _ in range(draws))
    lo, hi = sample[int(0.025 * draws)], sample[int(0.975 * draws) - 1]
    print(f"{name}: {ratio(keys):.3f} (95% {lo:.3f}-{hi:.3f}, {len(keys)} turns)")
    return ratio(keys)
