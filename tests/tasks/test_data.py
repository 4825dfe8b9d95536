"""task=data: JSONL and Parquet files, chat prompts, column names, the held-out split, and one-line errors."""

import json
import random
import warnings

import pytest
from omegaconf import OmegaConf
from typer.testing import CliRunner

from cli.main import app
from gspo.config.loading import compose
from gspo.config.schema import TaskConfig
from gspo.core.errors import ConfigError
from gspo.tasks import Problem, Verdict, build_task
from gspo.tasks.data import SMALL_HELDOUT, check_answer, final_answer, normalise
from gspo.train.preflight import check
from tests.conftest import REPO, tiny

# small files are the point of several tests here; the warning itself is tested where it matters
pytestmark = pytest.mark.filterwarnings("ignore:task.path=.*held-out problems:UserWarning")


def write_jsonl(path, rows, raw_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(raw_lines))
    return path


def task(path, **kw):
    return build_task(OmegaConf.structured(TaskConfig(name="data", path=str(path), **kw)))


def rows(n, prefix="What is"):
    return [{"prompt": f"{prefix} {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(n)]


# --------------------------------------------------------------------------- reading and errors


def test_a_malformed_line_names_the_files_line(tmp_path):
    """Blank lines count: the message gives the line an editor shows, not the row index."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n\n{"prompt": "b", "answer": 2,}\n')
    with pytest.raises(ConfigError, match=r"d\.jsonl:4: not valid JSON \(.* at column 29\)"):
        task(path)


def test_a_missing_field_names_the_line_the_fields_and_the_key(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"question": "b", "answer": "2"}])
    with pytest.raises(ConfigError, match=r"d\.jsonl:2: no 'prompt' field \(the row has: question, answer\).*task\.prompt_column"):
        task(path)


@pytest.mark.parametrize("text, message", [
    ("", "the file has no rows"),
    ("\n  \n", "the file has no rows"),
    ('[1, 2]\n', r"d\.jsonl:1: a row must be a JSON object, got list"),
    ('{"prompt": "", "answer": "1"}\n', r"d\.jsonl:1: the prompt \('prompt'\) is empty"),
    ('{"prompt": "a", "answer": null}\n', r"d\.jsonl:1: the answer \('answer'\) must be a non-empty string or a number"),
    ('{"prompt": [{"role": "user"}], "answer": "1"}\n', r"d\.jsonl:1: the prompt \('prompt'\) must be a string or a list"),
])
def test_bad_files_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "d.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as e:
        task(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("content", ["", '{"prompt": "a"}\n', '{"prompt": "a", "answer": "1"\n'])
def test_bad_files_exit_2_before_any_work_without_a_traceback(tmp_path, cache_dir, content):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    res = CliRunner().invoke(app, ["train", "task=data", f"task.path={path}", *tiny(cache_dir, model="qwen3-tiny")])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and str(path) in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "outputs").exists()


def test_task_jsonl_is_the_same_task(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(60))
    a = task(path)
    b = build_task(OmegaConf.structured(TaskConfig(name="jsonl", path=str(path))))
    assert a.eval_set(100) == b.eval_set(100) and b.name == "jsonl"


def test_parquet_with_chat_messages_and_named_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = [{"messages": [{"role": "user", "content": f"q{i}"}], "solution": f"#### {i}", "level": i % 3}
            for i in range(80)]
    pq.write_table(pa.Table.from_pylist(data), tmp_path / "d.parquet")
    t = task(tmp_path / "d.parquet", prompt_column="messages", answer_column="solution")
    p = next(p for p in t.train + t.heldout if p.answer == "#### 0")
    assert p.prompt == [{"role": "user", "content": "q0"}] and p.answer == "#### 0"
    assert p.meta["row"] == {"solution": "#### 0", "level": 0}  # every column but the prompt, for reward functions
    with pytest.raises(ConfigError, match=r"d\.parquet row 1: no 'prompt' field \(the row has: messages, solution, level\)"):
        task(tmp_path / "d.parquet")


def test_a_corrupt_parquet_file_is_one_line(tmp_path):
    (tmp_path / "d.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match=r"d\.parquet: not a readable Parquet file"):
        task(tmp_path / "d.parquet")


def test_system_prompt_goes_before_prompts_without_one(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "plain", "answer": "1"},
        {"prompt": [{"role": "user", "content": "chat"}], "answer": "2"},
        {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "chat2"}], "answer": "3"},
    ] * 1)
    t = task(path, system_prompt="SYS", eval_fraction=0.5)
    by_answer = {p.answer: p.prompt for p in t.train + t.heldout}
    assert by_answer["1"] == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "plain"}]
    assert by_answer["2"] == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "chat"}]
    assert by_answer["3"][0] == {"role": "system", "content": "own"}  # the row's own system message wins


# --------------------------------------------------------------------------- the split


def test_duplicates_never_straddle_the_split(tmp_path):
    """The same problem written with different whitespace (or a different system message) is one key."""
    data = []
    for i in range(300):
        data.append({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)})
        data.append({"prompt": f"  What is  {i}\n+ {i}? ", "answer": str(2 * i)})
        data.append({"prompt": [{"role": "system", "content": "x"}, {"role": "user", "content": f"What is {i} + {i}?"}],
                     "answer": str(2 * i)})
    t = task(write_jsonl(tmp_path / "d.jsonl", data), eval_fraction=0.2)
    held = {normalise(p.prompt) for p in t.heldout}
    train = {normalise(p.prompt) for p in t.train}
    assert held and train and not held & train
    assert len(t.heldout) == len(held)  # a duplicated held-out problem is scored once
    assert 0.1 < len(held) / 300 < 0.3
    assert {normalise(p.prompt) for p in t.sample_train(random.Random(0), 2000)} <= {normalise(p.prompt) for p in t.train}


def test_normalise_collapses_whitespace_and_drops_system_turns():
    assert normalise(" a \n b\t c ") == "user: a b c"
    assert normalise([{"role": "system", "content": "s"}, {"role": "user", "content": " a  b"}]) == "user: a b"


def test_a_small_heldout_set_warns_and_reports_its_true_size(tmp_path):
    t = None
    with pytest.warns(UserWarning, match=r"only \d+ held-out problems \(20 rows, task\.eval_fraction=0\.1\)"):
        t = task(write_jsonl(tmp_path / "d.jsonl", rows(20)))
    assert 0 < len(t.eval_set(200)) == len(t.heldout) < SMALL_HELDOUT
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        task(write_jsonl(tmp_path / "big.jsonl", rows(1000)))  # 1000 rows: ~100 held out, no warning


def test_no_heldout_problems_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="3 rows leave no held-out problems"):
        task(write_jsonl(tmp_path / "d.jsonl", rows(3)), eval_fraction=0.01)


# --------------------------------------------------------------------------- answers


@pytest.mark.parametrize("completion, answer, verdict", [
    ("3 + 4 = 7\n#### 7", "#### 7", (True, True)),
    ("#### 1,234", "Total: 1234\n#### 1234", (True, True)),
    ("so #### 8\nthanks", "#### 8", (True, True)),  # what follows #### on its line
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", (True, True)),
    ("#### 6", "#### 7", (False, True)),
    ("no number here", "#### 7", (False, False)),
    ("", "#### 7", (False, False)),
    ("  paris ", "Paris", (True, True)),  # not math: compared as text
    ("London", "Paris", (False, True)),
])
def test_answers_are_checked_with_math_verify(completion, answer, verdict):
    assert check_answer(completion, answer) == Verdict(*verdict)


# MATH-500's `answer` column is bare LaTeX: no $...$, no \\boxed{}. (Before, math-verify's default extraction read
# 2\\sqrt{3} as 2 and 10\\% as 10, and gave up on the rest, comparing them as text.)
MATH_ANSWERS = [  # reference, a right completion, a wrong one
    ("2\\sqrt{3}", "\\boxed{2\\sqrt{3}}", "\\boxed{2}"),
    ("10\\%", "\\boxed{10\\%}", "\\boxed{11\\%}"),
    ("\\sqrt{2}", "\\boxed{\\sqrt{2}}", "\\boxed{2}"),
    ("\\dfrac{3}{4}", "\\boxed{0.75}", "\\boxed{\\frac{4}{3}}"),
    ("(1,2)", "\\boxed{(1,2)}", "\\boxed{(2,1)}"),
    ("x^2+1", "\\boxed{1+x^2}", "\\boxed{x^2-1}"),
    ("\\pi", "\\boxed{\\pi}", "\\boxed{3}"),
]


@pytest.mark.parametrize("answer, right, wrong", MATH_ANSWERS)
def test_math_style_references_are_read_as_latex(answer, right, wrong):
    assert check_answer(right, answer) == Verdict(True, True)
    assert check_answer(wrong, answer) == Verdict(False, True)


def test_math_style_answers_score_as_tinyzero_says(tmp_path):
    """Through the task (math-verify in its own process) and the tinyzero reward: right 1.0, wrong 0.1."""
    from omegaconf import OmegaConf

    from gspo.config.schema import RewardConfig
    from gspo.tasks.rewards import score

    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": a}) for i, (a, _, _) in enumerate(MATH_ANSWERS)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = task(path, eval_fraction=0.3)
    problems = {p.answer: p for p in t.train + t.heldout}
    rows = [problems[a] for a, _, _ in MATH_ANSWERS for _ in (0, 1)]
    texts = [c for _, right, wrong in MATH_ANSWERS for c in (right, wrong)]
    r, parts = score(t, OmegaConf.structured(RewardConfig(name="tinyzero")), texts, rows)
    assert r.tolist() == pytest.approx([1.0, 0.1] * len(MATH_ANSWERS))
    assert parts["verify_timeout"].tolist() == [0.0] * len(texts)


def test_a_completion_can_never_hang_the_math_checker():
    """\\boxed{9^{9^{9^{9}}}} holds the GIL in one big-integer power (still running after 200 s before, past
    reward.timeout_s); \\boxed{10!!!!} is merely slow (it ended the run with exit 2). Both score 0 now, the first
    counted as timed out, and the next completion is checked as usual."""
    from gspo.tasks.mathcheck import MathChecker

    checker = MathChecker(item_timeout_s=3)
    try:
        got = checker.verdicts([("\\boxed{9^{9^{9^{9}}}}", "3"), ("\\boxed{3}", "3"), ("\\boxed{10!!!!}", "3"),
                                ("\\boxed{4}", "4")])
    finally:
        checker.close()
    assert [v.correct for v in got] == [False, True, False, True]
    assert got[0].timed_out and not got[1].timed_out and not got[3].timed_out


def test_final_answer_takes_what_follows_the_last_marker():
    assert final_answer("a #### 1\nb #### 2\nc") == "2"
    assert final_answer("no marker 5") == "no marker 5"


def test_references_of_the_shipped_example_verify():

    path = REPO / "examples" / "arithmetic_chat.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a small file: the warning is expected
        t = task(path, prompt_column="messages", eval_fraction=0.25)
    for p in t.train + t.heldout:
        assert t.verify(p.answer, p) == Verdict(True, True), p.answer
        assert t.verify("#### 99999", p) == Verdict(False, True)


# --------------------------------------------------------------------------- what the model can render


def test_chat_prompts_need_a_chat_template(tmp_path, cache_dir):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)}
                                              for i in range(40)])
    with pytest.raises(ConfigError, match="chat messages, which need a tokenizer with a chat template; model=qwen3-tiny"):
        check(compose(tiny(cache_dir, model="qwen3-tiny", task="data", **{"task.path": path})))
    plain = write_jsonl(tmp_path / "p.jsonl", rows(40))
    with pytest.raises(ConfigError, match="task.system_prompt is set"):
        check(compose(tiny(cache_dir, task="data", **{"task.path": plain, "task.system_prompt": "S"})))
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "tokenizer_config.json").write_text("{}")
    (model_dir / "tokenizer.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"the tokenizer in model.path=.* has none"):
        check(compose(["model=hf", f"model.path={model_dir}", "task=data", f"task.path={path}"]))


def test_eval_reports_the_true_number_of_problems(tmp_path, cache_dir):
    """20 rows hold out 2-3 problems: summary.json and eval.json say so, not task.eval_size=200."""
    from gspo.results.evaluate import run_eval
    from gspo.train.loop.trainer import train

    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(20)])
    with pytest.warns(UserWarning, match="held-out problems"):
        cfg = compose(tiny(cache_dir, model="qwen3-tiny", task="data",
                           **{"task.path": path, "task.eval_size": 200, "train.steps": 1}))
        n = len(build_task(cfg.task).heldout)
        summary = train(cfg, tmp_path / "run")
        res = run_eval(str(tmp_path / "run"), [], examples=0, pass_k=1)
    assert summary["eval_n"] == n and res["n"] == n < 200
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["n"] == n
    assert isinstance(Problem("a", "b").prompt, str)


def test_jsonl_rows_split_at_newlines_only_and_every_row_has_every_column(tmp_path):
    """A raw U+2028 inside a JSON string is valid JSON (str.splitlines() split the row there); a column some
    rows lack is None in the others, as a Parquet table or a datasets.Dataset has it."""
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": f"p{i}\u2028line", "answer": str(i), **({"level": i} if i % 2 else {})} for i in range(40)]
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = task(path, eval_fraction=0.2)
    problems = t.train + t.heldout
    assert len(problems) == 40 and all("\u2028" in p.prompt for p in problems)
    assert all(set(p.meta["row"]) == {"answer", "level"} for p in problems)
    assert {p.meta["row"]["level"] for p in problems if int(p.answer) % 2 == 0} == {None}


def test_the_eval_set_is_a_seeded_sample_not_the_files_first_rows(tmp_path):
    """A file sorted by level: the held-out problems scored are drawn from all of it (before: the first
    eval_size in file order, 187 of 200 from level 1), the same ones in every run."""
    path = tmp_path / "sorted.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i), "level": 1 + i * 5 // 2000})
                              for i in range(2000)))
    t = task(path, eval_fraction=0.5)
    picked = t.eval_set(200)
    assert len(picked) == 200 and picked == task(path, eval_fraction=0.5).eval_set(200)
    levels = [p.meta["row"]["level"] for p in picked]
    assert max(levels.count(level) for level in set(levels)) < 80  # about 40 of each of the 5 levels
