"""Data loading, error messages, the GSM8K download path (against a local HTTP server) and prompts."""

import functools
import http.server
import json
import re
import threading

import pytest

from alignment import data
from alignment.tasks import is_held_out


def test_gsm8k_rows_have_question_gold_and_solution(data_dir):
    rows = data.load_gsm8k("test", str(data_dir))
    assert len(rows) == 1319
    assert rows[0]["answer"] == "18" and rows[0]["solution"].endswith("#### 18")
    assert len(data.load_dataset("gsm8k", "train", str(data_dir))) == 7473


@pytest.mark.parametrize("name,count", [("math500", 500), ("aime24", 30), ("aime25", 30), ("amc23", 40),
                                        ("olympiadbench", 675)])
def test_math_style_sets(data_dir, name, count):
    rows = data.load_dataset(name, "test", str(data_dir))
    assert len(rows) == count and all(r["question"] and isinstance(r["answer"], str) for r in rows)


def test_data_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("ALIGNMENT_DATA_DIR", str(tmp_path / "env"))
    assert data.resolve_data_dir("given") == data.Path("given")
    assert data.resolve_data_dir() == tmp_path / "env"
    monkeypatch.delenv("ALIGNMENT_DATA_DIR")
    assert data.resolve_data_dir() == data.REPO_ROOT / "dataset"


def test_malformed_file_names_file_and_line(tmp_path):
    (tmp_path / "math500").mkdir()
    path = tmp_path / "math500" / "test.jsonl"
    path.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "oops"\n')
    with pytest.raises(ValueError, match=r"test.jsonl:2 is not valid JSON"):
        data.load_dataset("math500", data_dir=str(tmp_path))
    path.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "no answer"}\n')
    with pytest.raises(ValueError, match=r"test.jsonl:2 lacks field\(s\) answer"):
        data.load_dataset("math500", data_dir=str(tmp_path))


def test_missing_files_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="aime24 test.jsonl"):
        data.load_dataset("aime24", data_dir=str(tmp_path))
    monkeypatch.setenv("ALIGNMENT_GSM8K_URL", "http://127.0.0.1:9/nothing")  # nothing listens on port 9
    with pytest.raises(FileNotFoundError, match="could not download .*/test.jsonl .* copy GSM8K's test.jsonl .* "
                                                "point --data_dir at a folder that has it"):
        data.load_gsm8k("test", str(tmp_path))
    assert not (tmp_path / "gsm8k").exists()  # the folder made for the download is not left behind
    with pytest.raises(ValueError, match="unknown dataset"):
        data.load_dataset("mmlu", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="only a test split"):
        data.load_dataset("math500", "train", str(tmp_path))


@pytest.fixture
def gsm8k_server(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    for split in ("train", "test"):
        rows = [{"question": f"{split} q{i}", "answer": f"work <<1+1=2>>2\n#### {i}"} for i in range(3)]
        (served / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_download_on_first_use_from_a_local_server(gsm8k_server, tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNMENT_GSM8K_URL", gsm8k_server)
    rows = data.load_gsm8k("test", str(tmp_path / "data"))  # files missing: fetched on first use
    assert [r["answer"] for r in rows] == ["0", "1", "2"] and rows[0]["question"] == "test q0"
    # only the split asked for: a new --data_dir without a network once asked evaluate for a train split
    assert not (tmp_path / "data" / "gsm8k" / "train.jsonl").exists()
    assert not list((tmp_path / "data" / "gsm8k").glob("*.tmp"))


def test_download_command(gsm8k_server, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ALIGNMENT_GSM8K_URL", gsm8k_server)
    data.main(["download", "gsm8k", "--data_dir", str(tmp_path)])
    assert "test.jsonl: 3 rows" in capsys.readouterr().out


def test_prompts():
    r1 = data.load_prompt("r1_zero")
    assert r1.endswith("Assistant: <think>") and "{question}" in r1
    filled = data.format_prompt(r1, "What is {x} in \\frac{1}{2}?")
    assert "User: What is {x} in \\frac{1}{2}?\nAssistant: <think>" in filled
    assert "\\boxed{}" in data.load_prompt("question_only")
    with pytest.raises(ValueError, match="unknown prompt 'nope'; choose one of .*r1_zero"):
        data.load_prompt("nope")


def test_reasoning_gym_tasks_with_options_are_seeded_and_split():
    rows = data.load_dataset("rg:chain_sum:max_terms=2,max_digits=1", "train", size=20, seed=3)
    assert rows == data.load_dataset("rg:chain_sum:max_terms=2,max_digits=1", "train", size=20, seed=3)
    for row in rows:  # two one-digit terms, and the gold is their value
        expression = row["question"].rsplit(":", 1)[1].strip().rstrip("=")
        terms = expression.replace("-", "+").split("+")
        assert len(terms) == 2 and all(len(t.strip()) == 1 for t in terms)
        assert eval(expression) == int(row["answer"])
    test = data.load_dataset("rg:chain_sum:max_terms=2,max_digits=1", "test", size=20, seed=3)
    assert [r["question"] for r in test] != [r["question"] for r in rows]


def test_repeated_addition_holds_out_half_its_pairs_and_repeats_none_before_all_have_come():
    """alignment/tasks.py, issue 63: the question's size does not grow with the count; the gold is start + step x
    times; held_out=true rows and the others never share a question (a pair's half is a hash of the pair), whatever
    the seeds; the first rows of a half, as many as its pairs, are all different."""
    spec = "rg:repeated_addition:min_times=7,max_times=7"
    trained = data.load_dataset(spec, "train", size=2000, seed=0) + data.load_dataset(spec, "test", size=2000, seed=5)
    half = sum(is_held_out((start, step)) for start in range(10, 100) for step in range(2, 10))
    assert 300 < half < 420  # about half of the 720 pairs
    held_out = data.load_dataset(spec + ",held_out=true", "test", size=half, seed=1)
    assert len({r["question"] for r in held_out}) == half
    assert not {r["question"] for r in held_out} & {r["question"] for r in trained}
    for row in held_out[:50] + trained[:50]:
        start, step, times = map(int, re.findall(r"\d+", row["question"]))
        assert times == 7 and 10 <= start <= 99 and 2 <= step <= 9 and int(row["answer"]) == start + step * times
    for rows in (held_out, trained):  # each half holds every step and every parity of start and step
        pairs = [tuple(map(int, re.findall(r"\d+", r["question"])[:2])) for r in rows]
        assert {step for _, step in pairs} == set(range(2, 10))
        assert {(start % 2, step % 2) for start, step in pairs} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    long = data.load_dataset("rg:repeated_addition:min_times=29,max_times=29", size=50)
    assert {len(r["question"]) for r in long} == {len(trained[0]["question"]) + 1}  # one more digit in the count


def test_add_until_stops_at_a_bound_between_two_totals_and_holds_out_half_its_pairs():
    """alignment/tasks.py, issue 63's next recipe: the chain needs `times` additions (the bound lies strictly between
    the last two totals, so no total equals it), every total stays under max_total at every length, and held-out
    rows never share a question or a (start, step) pair with the others."""
    for times in (1, 7, 29):
        spec = f"rg:add_until:min_times={times},max_times={times}"
        rows = data.load_dataset(spec, "train", size=300, seed=0) + data.load_dataset(spec + ",held_out=true", "test", size=300)
        for row in rows:
            start, step, bound = map(int, re.findall(r"\d+", row["question"]))
            assert start + (times - 1) * step < bound < start + times * step == int(row["answer"]) <= 799
            assert 100 <= start <= 699 and 2 <= step <= 9
    spec = "rg:add_until:min_times=1,max_times=5"
    pairs = {held: {tuple(map(int, re.findall(r"\d+", r["question"])[:2]))
                    for r in data.load_dataset(spec + f",held_out={held}", "train", size=2000, seed=2)} for held in ("true", "false")}
    assert len(pairs["true"]) > 1000 and not pairs["true"] & pairs["false"]
    long = data.load_dataset("rg:add_until:min_times=29,max_times=29", size=50)
    assert {len(r["question"]) for r in long} == {len(rows[0]["question"])}  # the same size at every length


@pytest.mark.parametrize("task", ["repeated_addition", "add_until"])
def test_a_pairs_half_does_not_depend_on_the_ranges(task):
    """Issue 77.3: the held-out half was the first half of the list of pairs shuffled, so widening a range
    reshuffled both halves (max_start=120: 32 of 100 "held-out" questions had been trained on)."""
    def pairs(spec, split):
        return {tuple(map(int, re.findall(r"\d+", r["question"])[:2])) for r in data.load_dataset(spec, split, size=2000)}

    wider = "max_start=120" if task == "repeated_addition" else "max_start=720,max_total=820"
    for trained, held_out in ((f"rg:{task}", f"rg:{task}:{wider},held_out=true"),
                              (f"rg:{task}:{wider}", f"rg:{task}:held_out=true")):
        assert len(pairs(trained, "train")) > 300 and len(pairs(held_out, "test")) > 300
        assert not pairs(trained, "train") & pairs(held_out, "test")


def test_seeds_draw_different_training_questions_and_one_test_split():
    """Issue 77.4: reasoning-gym seeds row i with `seed + i`, so run seed 1's rows were seed 0's shifted by one
    (the three-seed demos shared 959 of 960 SFT questions). Each seed's training split now has its own data seed;
    the test split is the same for every seed (what evaluate and every run's held-out set score)."""
    spec = "rg:chain_sum:min_terms=3,max_terms=3,max_digits=3"
    seeds = [{r["question"] for r in data.load_dataset(spec, "train", size=200, seed=seed)} for seed in (0, 1, 2)]
    assert all(len(a & b) < 10 for a in seeds for b in seeds if a is not b)
    tests = [data.load_dataset(spec, "test", size=100, seed=seed) for seed in (0, 1, 7)]
    assert tests[0] == tests[1] == tests[2] == data.load_dataset(spec, "test", size=100)
    assert data.load_dataset(spec, "test", size=100) == data.load_dataset(spec, "test", size=2000)[:100]


@pytest.mark.parametrize("name,message", [("rg:chain_sum:max_terms", "key=value"),
                                          ("rg:add_until:min_times=29,max_times=29,max_total=300", "rejected the options"),
                                          ("rg:repeated_addition:min_times=5,max_times=2", "rejected the options"),
                                          ("rg:chain_sum:colour=red", "rejected the options"),
                                          ("rg:no_such_task", "has no task"),
                                          ("rg:chain_sum:max_terms=3,max_terms=5", "max_terms is given twice"),
                                          ("rg:basic_arithmetic:allow_parentheses=false", "gets \\* and / wrong"),
                                          ("rg:basic_arithmetic:operators=+*,allow_parentheses=false", "no precedence"),
                                          ("rg:products:max_digits=99999", "max_digits=99999 is above 1,000"),
                                          ("rg:chain_sum:max_terms=1000000", "max_terms=1000000 is above 100,000"),
                                          ("rg:basic_arithmetic:operators=/", "cannot generate a problem")])
def test_bad_reasoning_gym_specs_say_what_to_do(name, message):
    with pytest.raises(ValueError, match=message):
        data.load_dataset(name, size=2)


def test_basic_arithmetic_without_parentheses_is_refused_only_where_its_answers_are_wrong():
    """reasoning-gym evaluates an unparenthesised chain left to right: `2 + 3 * 4` comes out 20. The refused
    settings do disagree with the printed question; the kept ones agree."""
    kept = data.load_dataset("rg:basic_arithmetic:operators=+-,allow_parentheses=false", size=50)
    assert all(eval(r["question"][len("Calculate "):].rstrip(".")) == int(r["answer"]) for r in kept)
    import reasoning_gym
    wrong = reasoning_gym.create_dataset("basic_arithmetic", size=50, seed=0, operators="+-*", allow_parentheses=False)
    assert any(eval(item["question"][len("Calculate "):].rstrip(".")) != int(item["answer"]) for item in wrong)


def test_a_file_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_bytes(b'{"prompt": "p", "response": "r"}\n{"prompt": "caf\xe9", "response": "r"}\n')
    with pytest.raises(data.UserError, match=r"traces.jsonl:2 is not UTF-8 text .*save the file as UTF-8"):
        data.read_jsonl(path, ("prompt", "response"))


def test_a_users_own_file_is_to_be_fixed_not_downloaded(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_text('{"prompt": "p", "response": "r"}\n{"prompt": "oops"\n')
    with pytest.raises(data.UserError, match=r"traces.jsonl:2 is not valid JSON .*; fix the file") as error:
        data.read_jsonl(path, ("prompt", "response"))
    assert "download" not in str(error.value)
    path.write_text("\n")
    with pytest.raises(data.UserError, match=r"traces.jsonl holds no rows; fix the file") as error:
        data.read_jsonl(path, ("prompt", "response"))
    assert "download" not in str(error.value)
    path.write_text("[1, 2]\n")
    with pytest.raises(data.UserError, match=r"traces.jsonl:1 is not a JSON object"):
        data.read_jsonl(path, ("prompt", "response"))


def test_dataset_files_keep_their_own_advice(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text('{"question"\n')
    with pytest.raises(data.UserError, match=r"test.jsonl:1 is not valid JSON .*download gsm8k` again"):
        data.load_gsm8k("test", str(tmp_path))
    (tmp_path / "aime24").mkdir()
    (tmp_path / "aime24" / "test.jsonl").write_text("")
    with pytest.raises(data.UserError, match=r"holds no rows; copy the aime24 test.jsonl"):
        data.load_dataset("aime24", data_dir=str(tmp_path))


def test_prompt_and_response_must_be_strings(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_text('{"prompt": 5, "response": null}\n')
    with pytest.raises(data.UserError, match=r"traces.jsonl:1: prompt and response must be strings "
                                             r"\(prompt is 5, response is null\); fix the file"):
        data.read_jsonl(path, ("prompt", "response"))


def test_a_folder_where_a_file_is_expected_and_the_reverse_are_named(tmp_path):
    with pytest.raises(data.UserError, match=r"is a folder, not a file; pass the JSONL file itself"):
        data.read_jsonl(tmp_path, ("prompt", "response"))
    (tmp_path / "math500").mkdir()
    (tmp_path / "math500" / "test.jsonl").mkdir()
    with pytest.raises(data.UserError, match=r"test.jsonl is a folder, not a file"):
        data.load_dataset("math500", data_dir=str(tmp_path))
    (tmp_path / "aime24").write_text("")
    with pytest.raises(data.UserError, match=r"aime24 is a file where a folder is expected"):
        data.load_dataset("aime24", data_dir=str(tmp_path))
    a_file = tmp_path / "data.txt"
    a_file.write_text("")
    for name in ("gsm8k", "math500"):
        with pytest.raises(data.UserError, match=r"data.txt is a file where a folder is expected"):
            data.load_dataset(name, data_dir=str(a_file))


def test_split_all_of_a_folder_with_named_splits_is_every_split_s_rows(tmp_path):
    """Issue 91: `--split all` on a `datasets` folder with train and test splits advised saving "a all split"; all is
    every row, as it is for a file. A split the folder lacks is still refused, naming its splits."""
    import datasets
    rows = [{"question": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(5)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:3]),
                          "test": datasets.Dataset.from_list(rows[3:])}).save_to_disk(str(tmp_path / "folder"))
    got = data.load_file(str(tmp_path / "folder"), "all")
    assert [r["question"] for r in got] == [r["question"] for r in rows]
    assert [r["question"] for r in data.load_file(str(tmp_path / "folder"), "test")] == [r["question"] for r in rows[3:]]
    with pytest.raises(data.UserError, match="has the splits train, test, not validation"):
        data.load_file(str(tmp_path / "folder"), "validation")
