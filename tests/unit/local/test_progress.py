"""Progress bookkeeping of a local run: log facts and lost steps at resumes."""

from disttrain.operator.local.logtail import LogFacts, parse_line
from disttrain.operator.local.summary import Recorder

STEP = "2026-11-29 12:00:00,000 [disttrain rank 0] INFO step {} loss 1.2500 lr 0.003 world 3 samples/s 640"


def test_log_lines_give_loss_rate_resumes_and_drains():
    facts = LogFacts()
    parse_line("... INFO no complete checkpoint in /x: starting at step 0 (world size 3, plan {})", facts, 1.0)
    parse_line(STEP.format(20), facts, 2.0)
    parse_line("... INFO drained at step 23 (drain signal generation 1: ScaledUp): checkpoint step-23", facts, 3.0)
    for rank in range(3):  # every rank logs its resume: one record
        parse_line(f"[disttrain rank {rank}] INFO resumed from checkpoint step-23 (saved at world size 3)", facts, 4.0)
    assert (facts.step, facts.loss, facts.world, facts.samples_per_second) == (20, 1.25, 3, 640.0)
    assert facts.resumes == [(1.0, 0), (4.0, 23)]
    assert facts.drains == [(3.0, 23)]


def test_lost_steps_are_the_peak_before_a_resume_minus_its_checkpoint():
    recorder = Recorder()
    facts = LogFacts(resumes=[(0.5, 0), (10.0, 20), (30.0, 40)], drains=[(29.0, 40)])
    for t, step in [(1, 5), (5, 24), (9, 26), (12, 22), (28, 39)]:
        recorder.on_status({"step": step}, facts, float(t))
    lost = recorder.lost_steps_at_resumes(facts)
    assert [(resumed, n) for _, resumed, n in lost] == [(20, 6), (40, 0)]
