"""llama-server's step log read back into steps, on canned lines in the pinned server's format (taken from a
real `-lv 5 --log-timestamps` log, with the HTTP threads' lines between them). Runs everywhere."""
import pytest

from servingplan.llamacpp.server_log import ServerLogError, check_rule, read_steps

# two slots, n_batch 64: task 0 (100 tokens) on slot 1, task 2 (40 tokens) on slot 0 arriving during its first step
LOG = """\
0.00.409.801 I slot launch_slot_: id  1 | task 0 | processing task, is_child = 0
0.00.409.900 I slot   operator(): id  1 | task 0 | new prompt, n_ctx_slot = 1024, n_keep = 0, task.n_tokens = 100
0.00.409.927 I slot   operator(): id  1 | task 0 | cached n_tokens = 0, memory_seq_rm [0, end)
0.00.409.942 D slot   operator(): id  1 | task 0 | main/do_checkpoint = no, pos_min = -1, pos_max = -1
0.00.409.958 D srv        decode: n_batch (effective) = 64, off = 0
0.00.409.959 D que  yield_to_que: yielding to queue
0.00.410.108 D que  process_new_: processing task, id = 1
0.00.463.585 I srv  server_strea: conv_id= (empty=1)
0.00.498.660 D que  yield_to_que: done yielding to queue
0.00.498.984 I slot launch_slot_: id  0 | task 2 | processing task, is_child = 0
0.00.498.990 D No parser definition detected, assuming pure content parser.0.00.499.047 I slot   operator(): id  0 | task 2 | new prompt, n_ctx_slot = 1024, n_keep = 0, task.n_tokens = 40
0.00.499.247 I slot   operator(): id  0 | task 2 | cached n_tokens = 0, memory_seq_rm [0, end)
0.00.499.336 I slot   operator(): id  1 | task 0 | cached n_tokens = 64, memory_seq_rm [64, end)
0.00.499.411 D srv        decode: n_batch (effective) = 64, off = 0
0.00.499.424 D que  yield_to_que: yielding to queue
0.00.594.302 D que  yield_to_que: done yielding to queue
0.00.594.772 D slot process_toke: id  0 | task 2 | n_gen = 1, n_remaining = 2, next token: 13744 'U'
0.00.594.997 D slot handle_last_: id  0 | task 2 | slot decode token, id=13744, n_ctx = 1024, n_tokens = 40, truncated = 0
0.00.595.026 I slot   operator(): id  1 | task 0 | cached n_tokens = 88, memory_seq_rm [88, end)
0.00.595.155 D srv        decode: n_batch (effective) = 64, off = 0
0.00.595.168 D que  yield_to_que: yielding to queue
0.00.632.128 D que  yield_to_que: done yielding to queue
0.00.633.138 D slot handle_last_: id  0 | task 2 | slot decode token, id=27576, n_ctx = 1024, n_tokens = 41, truncated = 0
0.00.633.152 D slot handle_last_: id  1 | task 0 | slot decode token, id=47117, n_ctx = 1024, n_tokens = 100, truncated = 0
0.00.633.211 D srv        decode: n_batch (effective) = 64, off = 0
0.00.633.225 D que  yield_to_que: yielding to queue
0.00.656.252 D que  yield_to_que: done yielding to queue
"""


def test_each_step_holds_its_decodes_and_prompt_chunks_and_lasts_until_its_result():
    steps = read_steps(LOG)
    assert [step.decodes for step in steps] == [[], [], [(0, 40)], [(0, 41), (1, 100)]]
    # chunks in slot order: slot 0's whole 40-token prompt, then slot 1's next 24 tokens (64 to 88), then 12 (88 to 100)
    assert [step.prefills for step in steps] == [[(1, 64, 0)], [(0, 40, 0), (1, 24, 64)], [(1, 12, 88)], []]
    assert [round(step.duration_s * 1e6) for step in steps] == [88702, 94891, 36973, 23041]
    assert [step.prompt_left for step in steps] == [True, True, False, False]
    assert check_rule(steps) == {"steps": 4, "over_n_batch": 0, "split_without_full_batch": 0, "prompt_chunks": 4,
                                 "split_chunks": 2}


def test_a_split_prompt_in_a_batch_that_was_not_full_breaks_the_rule():
    # the second step left task 0 unfinished with room to spare in its batch: not how llama-server fills one
    log = LOG.replace("cached n_tokens = 88, memory_seq_rm", "cached n_tokens = 80, memory_seq_rm")
    steps = read_steps(log)
    assert steps[1].tokens == 56 and steps[1].prompt_left
    assert check_rule(steps)["split_without_full_batch"] == 1


@pytest.mark.parametrize("log, says", [
    ("", "no `n_batch (effective)` line"),
    (LOG.replace("off = 0", "off = 32", 1), "a batch decoded in parts (off = 32)"),
    (LOG.replace("new prompt, n_ctx_slot = 1024, n_keep = 0, task.n_tokens = 40", "(line lost)"),
     "task 2 adds prompt tokens but its `new prompt` line is missing"),
])
def test_a_log_that_is_not_a_step_log_is_one_clear_line(log, says):
    with pytest.raises(ServerLogError) as refused:
        read_steps(log)
    assert says in str(refused.value) and len(str(refused.value).splitlines()) == 1


def test_a_running_servers_log_is_read_as_far_as_it_goes_and_its_reading_cost_grows_with_it(tmp_path):
    from servingplan.llamacpp.validation import LogSoFar

    path = tmp_path / "server.log"
    log = LogSoFar(path)
    # no log yet, then a log with no whole step yet: no steps, and nothing known of the cost
    assert log.steps() == [] and log.expected_s() == 0.0
    lines = LOG.splitlines(keepends=True)
    path.write_text("".join(lines[:4]))
    assert log.steps() == []
    # the first two steps logged, the third not yet: slot 1's second chunk reads as running to its prompt's end
    path.write_text("".join(lines[:19]))
    assert [step.prefills for step in log.steps()] == [[(1, 64, 0)], [(0, 40, 0), (1, 36, 64)]]
    assert log.seconds_per_byte > 0
    smaller = log.expected_s()
    path.write_text(LOG * 3)
    assert log.expected_s() == pytest.approx(smaller * len(LOG * 3) / len("".join(lines[:19])))
