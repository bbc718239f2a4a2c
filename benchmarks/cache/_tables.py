"""The tables of docs/results.md drawn from the rows of cache/'s benchmarks
(benchmarks/report.py renders them; benchmarks/_report holds the parts)."""
import _cache_oracles as oracles
from _report import Cell, Col, Fig, Row, Table, contender, fixed, pct, sig

TABLES = {}

# --- cache_plan.py ---
# The row cache's planners: cache_plan.py, 2026-11-29.
PLANNER_FOLDER = "cpu-2026-11-29-cache-planner"

# The simulator's candidates, as cache_plan.py names them ([index] name).
CANDIDATE_NAMES = [f"[{i}] {c.name}" for i, c in enumerate(oracles.CANDIDATES)]

PLANNER_FREQUENCY, PLANNER_CLOCK = "planner: CPU planner, frequency (default)", "planner: CPU planner, clock"

STATIC, STATIC_RANKS, BELADY = "oracle: static top-frequency", "oracle: static top ranks", "oracle: Belady (bypass)"


def _hit_rate_cols(protocols):
    """A column a (protocol, cache fraction): the hit rate, 4 places."""
    return [Col(f"{label} {fraction:.0%}", [Fig("hit_rate", fixed(4))],
                where={"workload.protocol": protocol, "workload.fraction": fraction})
            for protocol, label, fractions in protocols for fraction in fractions]


ANCHOR_PROTOCOLS = [("dynamicemb", "dynamicemb", (0.8, 0.5, 0.2)), ("fbgemm", "FBGEMM", (0.2, 0.05))]

OWN_PROTOCOLS = [("fresh", "fresh", (0.8, 0.5, 0.2, 0.05)), ("replayed", "replayed", (0.8, 0.5, 0.2, 0.05))]

POLICY_ROWS = [Row(["CPU planner, frequency (the default)"], contender(PLANNER_FREQUENCY), bold=(0,)),
               Row(["CPU planner, clock (before it)"], contender(PLANNER_CLOCK)),
               Row(["static top-frequency (oracle)"], contender(STATIC)),
               Row(["static top ranks by the generator's law (oracle)"], contender(STATIC_RANKS)),
               Row(["Belady with bypass (oracle)"], contender(BELADY))]

REFERENCE_COLS = [Col(f"{fraction:.0%}", [Fig("hit_rate", pct(1))], where={"workload.fraction": fraction})
                  for fraction in (1.0, 0.8, 0.2, 0.05)]


def _reference_rows():
    rows = []
    for stream, label in (("replayed", "a replayed 10-batch stream"), ("fresh", "a new batch every step")):
        for policy in ("frequency", "clock"):
            where = {"workload.stream": stream, "contender": f"CPU planner, {policy}"}
            rows.append(Row([f"hit rate, {label}", policy], where))
            rows.append(Row([f"plan ms/step, {label}", policy], where,
                            cells={j: Cell([Fig("plan_time_median", sig(3))]) for j in range(4)}))
    return rows


# The row cache's policies on the anchors' streams and hostembed's own
# (cache_plan.py --protocol): each planner, the oracles.
TABLES["cache-policy-anchors"] = Table(
    where={"benchmark": "cache_plan", "folder": PLANNER_FOLDER, "run": "cache_policy"},
    labels=[("policy", "---")], cols=_hit_rate_cols(ANCHOR_PROTOCOLS), rows=POLICY_ROWS)


TABLES["cache-policy-own"] = Table(
    where={"benchmark": "cache_plan", "folder": PLANNER_FOLDER, "run": "cache_policy"},
    labels=[("policy", "---")], cols=_hit_rate_cols(OWN_PROTOCOLS),
    rows=[row for row in POLICY_ROWS if row.where["contender"] != STATIC_RANKS])

# The candidates tried on the way to the frequency policy (the simulator).
TABLES["cache-policy-candidates"] = Table(
    where={"benchmark": "cache_plan", "folder": PLANNER_FOLDER, "run": "cache_policy"},
    labels=[("candidate (simulated)", "---")], cols=_hit_rate_cols(ANCHOR_PROTOCOLS),
    rows=[Row([name], {"contender": f"simulated: {name}"}) for name in CANDIDATE_NAMES])

# The reference stream: hit rates and planning time, each policy.
TABLES["cache-plan-reference"] = Table(
    where={"benchmark": "cache_plan", "folder": PLANNER_FOLDER, "workload.protect": 2},
    labels=[("figure, stream (cache: of the touched rows)", "---"), ("policy", "---")], cols=REFERENCE_COLS,
    rows=_reference_rows())
