"""Deterministic local search on an owner assignment, run after a constructive policy.

Rank r's *share* is the larger of its NS-cost share and its element share,
max(cost_r / mean cost, elements_r / mean elements), every rank carrying an even share
of the tail. The search lowers the vector of shares sorted from the worst rank down, in
lexicographic order (leximax): first the worst rank, then the second worst (so ties at
the top do not stall it), and so on; where two splits leave the same shares, it takes
the one with the smaller sum of squares of both shares of every rank (a more even
spread, which lets it walk along plateaus). A change touches two or three ranks and is
taken only if it strictly lowers their own (sorted shares, sum of squares), which
strictly lowers the whole model's: the search cannot cycle, and never ends worse than
it started.

Matrices of equal (cost, elements) are interchangeable, so a rank's state is its count
of each such class (its *configuration*), and the best change between two or three
configurations is a pure function of them: computed once, then remembered.

Changes, from the worst rank down (one rank per configuration):
  pair    re-split the matrices of two ranks: every move and swap between them and
          larger exchanges within a window around the current split, the window wide
          for the worst ranks only;
  triple  when no pair change is left: re-split the rank of most cost, and the rank of
          most elements, with two of the ranks of most slack.
It stops when the largest cost and the most elements both meet their lower bounds
(bounds.py), when no change is left, or after a count of evaluated splits: never on
time. Ties go to the lower rank and to the earlier split in a fixed enumeration, and
all arithmetic is on integers: every rank computes the same result from the same inputs.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from .bounds import max_load_bound
from .layout import ParamSpec

PAIR_WINDOWS = (27, 1024)  # first-rank configurations enumerated per pair (bar one class): narrow, wide
TRIPLE_WINDOW = 1024  # first-rank configurations enumerated per triple
TRIPLE_PARTNERS = 5  # configurations of most slack tried as partners in a triple
DEFAULT_BUDGET = 100_000  # evaluated splits (and looked-up pairs) per search: well under a second

Config = tuple[int, ...]
Score = tuple[tuple[int, ...], int]  # (shares sorted worst first, sum of squares)


def _threshold(low: int, slope: int, high: int, slope_down: int, limit: int) -> int:
    """Smallest x >= 0 with low + x * slope >= high - x * slope_down (limit + 1 if none)."""
    gap, total = high - low, slope + slope_down
    if gap <= 0:
        return 0
    return -(-gap // total) if total else limit + 1


class OwnerSearch:
    """Search state: each rank's matrices by class, and its configuration.

    Loads are kept as integer points (x, y): x = W * cost * E and
    y = (W * elements + tail) * C for totals C (cost) and E (elements: a matrix's
    ``ParamSpec.weight``, its elements plus its rule's extra state), so that
    max(x, y) is the share times C * E. ``owners`` maps every matrix name to its
    starting rank; :meth:`improve` searches, :meth:`owners` gives the result.
    """

    def __init__(
        self, matrices: Sequence[ParamSpec], world_size: int, tail_elements: int, owners: Mapping[str, int]
    ) -> None:
        classes = sorted({(p.cost, p.weight) for p in matrices}, reverse=True)
        index = {key: k for k, key in enumerate(classes)}
        total_cost = sum(p.cost for p in matrices)
        total_elements = sum(p.weight for p in matrices) + tail_elements
        wx, wy = (total_elements, total_cost) if total_cost else (0, 1)
        self.world_size = world_size
        self.dx = [world_size * c * wx for c, _ in classes]
        self.dy = [world_size * e * wy for _, e in classes]
        self.base = tail_elements * wy  # y of a rank without matrices
        self.names = [p.name for p in matrices]
        self.members: list[list[list[int]]] = [[[] for _ in classes] for _ in range(world_size)]
        for i, p in enumerate(matrices):  # ascending indices per class
            self.members[owners[p.name]][index[(p.cost, p.weight)]].append(i)
        self.config: list[Config] = [tuple(len(m) for m in row) for row in self.members]
        self.evaluations = 0
        self.bound_x = world_size * max_load_bound([p.cost for p in matrices], world_size) * wx
        self.bound_y = world_size * max_load_bound([p.weight for p in matrices], world_size) * wy + self.base
        self._points: dict[Config, tuple[int, int]] = {}
        self._splits: dict[tuple, tuple[Score, Config]] = {}
        self._pairs: dict[tuple, tuple | None] = {}
        self._triples: dict[tuple, tuple | None] = {}

    # ------------------------------------------------------------------ loads
    def point(self, config: Config) -> tuple[int, int]:
        """(x, y) of a rank holding ``config``."""
        if config not in self._points:
            x = sum(n * d for n, d in zip(config, self.dx))
            self._points[config] = (x, self.base + sum(n * d for n, d in zip(config, self.dy)))
        return self._points[config]

    def share(self, r: int) -> int:
        return max(self.point(self.config[r]))

    def score(self, *configs: Config) -> Score:
        points = [self.point(c) for c in configs]
        return tuple(sorted((max(p) for p in points), reverse=True)), sum(x * x + y * y for x, y in points)

    def owners(self) -> dict[str, int]:
        return {self.names[i]: r for r, row in enumerate(self.members) for m in row for i in m}

    def at_bounds(self) -> bool:
        """Whether the largest cost and the most matrix elements on a rank both meet their
        lower bounds (bounds.py): then no plan is better on either."""
        points = [self.point(c) for c in set(self.config)]
        return max(x for x, _ in points) <= self.bound_x and max(y for _, y in points) <= self.bound_y

    # ------------------------------------------------------------------ splits
    def _windows(self, total: Config, around: Config, classes: Sequence[int], cap: int) -> list[range]:
        """Counts to try per class: all, or a window around ``around`` narrowed until the
        product is at most ``cap``."""
        width = max(total)
        while True:
            ranges = [range(max(0, around[k] - width), min(total[k], around[k] + width) + 1) for k in classes]
            size = 1
            for r in ranges:
                size *= len(r)
            if size <= cap or width == 0:
                return ranges
            width = width - 1 if width < 4 else width * 3 // 4

    def best_split(self, total: Config, around: Config, cap: int) -> tuple[Score, Config]:
        """The split of ``total`` between two ranks of the smallest score, and the first
        rank's configuration. The count of the largest class is not enumerated: the
        first rank's share only grows with it and the second's only shrinks, so the
        best count is where they cross."""
        key = (total, around, cap)
        if key in self._splits:
            return self._splits[key]
        present = [k for k, n in enumerate(total) if n]
        last = max(present, key=lambda k: (total[k], -k)) if present else 0
        others = [k for k in present if k != last]
        all_x, all_y = self.point(total)
        all_y += self.base
        a, b, n_last = self.dx[last], self.dy[last], total[last]
        steps = [(self.dx[k], self.dy[k]) for k in others]
        best = None
        for counts in itertools.product(*self._windows(total, around, others, cap)):
            self.evaluations += 1
            x1, y1 = 0, self.base
            for n, (dx, dy) in zip(counts, steps):
                x1 += n * dx
                y1 += n * dy
            x2, y2 = all_x - x1, all_y - y1
            cross = min(
                max(_threshold(x1, a, x2, a, n_last), _threshold(x1, a, y2, b, n_last)),
                max(_threshold(y1, b, x2, a, n_last), _threshold(y1, b, y2, b, n_last)),
                n_last,
            )
            for m in (cross - 1, cross) if cross else (0,):
                p, q, r, s = x1 + m * a, y1 + m * b, x2 - m * a, y2 - m * b
                first, second = max(p, q), max(r, s)
                shares = (first, second) if first >= second else (second, first)
                if best is None or shares <= best[0][0]:
                    score = (shares, p * p + q * q + r * r + s * s)
                    if best is None or score < best[0]:
                        best = (score, counts, m)
        config = [0] * len(total)  # (the product always has one element: best is set)
        for k, n in zip(others, best[1]):
            config[k] = n
        config[last] = best[2]
        self._splits[key] = (best[0], tuple(config))
        return self._splits[key]

    def best_pair(self, a: Config, b: Config, cap: int) -> tuple | None:
        """(score, the first rank's configuration) of the best re-split of ``a`` and
        ``b`` if it strictly lowers their score, else None."""
        key = (a, b, cap)
        if key not in self._pairs:
            score, config = self.best_split(tuple(x + y for x, y in zip(a, b)), a, cap)
            self._pairs[key] = (score, config) if score < self.score(a, b) else None
        return self._pairs[key]

    def best_triple(self, a: Config, b: Config, c: Config) -> tuple | None:
        """(score, configurations) of the best re-split of three ranks if it strictly
        lowers their score, else None."""
        key = (a, b, c)
        if key in self._triples:
            return self._triples[key]
        total = tuple(x + y + z for x, y, z in zip(a, b, c))
        all_x, all_y = self.point(total)
        all_y += 2 * self.base
        present = [k for k, n in enumerate(total) if n]
        steps = [(self.dx[k], self.dy[k]) for k in present]
        best = old = (self.score(a, b, c), None)
        for counts in itertools.product(*self._windows(total, a, present, TRIPLE_WINDOW)):
            self.evaluations += 1
            x1, y1 = 0, self.base
            for n, (dx, dy) in zip(counts, steps):
                x1 += n * dx
                y1 += n * dy
            limit = best[0][0][0]  # the others share the rest: the worse has at least half of it
            if max(x1, y1) > limit or max(all_x - x1, all_y - y1) // 2 > limit:
                continue
            mine = [0] * len(total)
            for k, n in zip(present, counts):
                mine[k] = n
            rest = tuple(t - m for t, m in zip(total, mine))
            ((s1, s2), squares), second = self.best_split(rest, tuple(map(min, b, rest)), TRIPLE_WINDOW // 4)
            score = (tuple(sorted((max(x1, y1), s1, s2), reverse=True)), x1 * x1 + y1 * y1 + squares)
            if score < best[0]:
                best = (score, (tuple(mine), second, tuple(r - s for r, s in zip(rest, second))))
        self._triples[key] = best if best is not old else None
        return self._triples[key]

    # ------------------------------------------------------------------ the search
    def _representatives(self) -> list[int]:
        """The lowest rank of each configuration, worst share first."""
        seen: set[Config] = set()
        reps = []
        for r in sorted(range(self.world_size), key=lambda r: (-self.share(r), r)):
            if self.config[r] not in seen:
                seen.add(self.config[r])
                reps.append(r)
        return reps

    def _pair_change(self, r: int, reps: Sequence[int], cap: int) -> tuple | None:
        best = None
        for t in reps:
            if self.config[t] == self.config[r]:
                continue  # two equal ranks cannot both improve: their loads sum to twice one's
            self.evaluations += 1
            found = self.best_pair(self.config[r], self.config[t], cap)
            if found is not None and (best is None or found[0] < best[0]):
                rest = tuple(x + y - z for x, y, z in zip(self.config[r], self.config[t], found[1]))
                best = (found[0], (r, t), (found[1], rest))
        return best

    def _partners(self, r: int) -> list[int]:
        """Ranks of most slack, of TRIPLE_PARTNERS configurations (two where two ranks share one)."""
        by_config: dict[Config, list[int]] = {}
        for t in sorted(range(self.world_size), key=lambda t: (self.share(t), t)):
            if t != r and len(by_config.setdefault(self.config[t], [])) < 2:
                by_config[self.config[t]].append(t)
        firsts = sorted(by_config.values(), key=lambda ranks: (self.share(ranks[0]), ranks[0]))
        return [t for ranks in firsts[:TRIPLE_PARTNERS] for t in ranks]

    def _triple_change(self, r: int) -> tuple | None:
        best = None
        for t, u in itertools.combinations(self._partners(r), 2):
            self.evaluations += 1
            found = self.best_triple(self.config[r], self.config[t], self.config[u])
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], (r, t, u), found[1])
        return best

    def _worst_by_kind(self) -> list[int]:
        """The rank of largest cost and the rank of most elements (lowest on ties), each
        while above its bound."""
        worst = []
        for kind, bound in ((0, self.bound_x), (1, self.bound_y)):
            r = max(range(self.world_size), key=lambda r: (self.point(self.config[r])[kind], -r))
            if self.point(self.config[r])[kind] > bound and r not in worst:
                worst.append(r)
        return worst

    def _apply(self, ranks: Sequence[int], configs: Sequence[Config]) -> None:
        """Move matrices so that ``ranks`` hold ``configs``: per class, the ranks that
        lose give their highest indices, the ranks that gain take the lowest first."""
        for k in range(len(self.dx)):
            pool: list[int] = []
            for r, config in zip(ranks, configs):
                while len(self.members[r][k]) > config[k]:
                    pool.append(self.members[r][k].pop())
            pool.sort()
            for r, config in zip(ranks, configs):
                take = config[k] - len(self.members[r][k])
                if take > 0:
                    self.members[r][k] = sorted(self.members[r][k] + pool[:take])
                    del pool[:take]
        for r in ranks:
            self.config[r] = tuple(len(m) for m in self.members[r])

    def step(self) -> bool:
        """Apply one change: a pair change of the worst rank that has one, else a triple
        change; False when there is none."""
        reps = self._representatives()
        top = self.share(reps[0])
        for r in reps:
            change = self._pair_change(r, reps, PAIR_WINDOWS[0])
            if change is None and self.share(r) == top:
                change = self._pair_change(r, reps, PAIR_WINDOWS[1])
            if change is not None:
                self._apply(*change[1:])
                return True
        for r in self._worst_by_kind():
            change = self._triple_change(r)
            if change is not None:
                self._apply(*change[1:])
                return True
        return False

    def improve(self, budget: int = DEFAULT_BUDGET) -> int:
        """Search until no change is left, both bounds are met or ``budget`` splits were
        evaluated; returns the number of changes made."""
        changes = 0
        if self.world_size < 2 or not self.dx:
            return changes
        while self.evaluations < budget and not self.at_bounds() and self.step():
            changes += 1
        return changes
