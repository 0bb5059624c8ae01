"""Prompt files: the accepted schemas and the errors for everything else."""

from __future__ import annotations

import json

import pytest

from tlt.data import load_prompts


def test_list_of_strings(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(["a prompt", "another"]))
    recs = load_prompts(f)
    assert [r.text for r in recs] == ["a prompt", "another"] and recs[0].messages is None


def test_jsonl_messages_with_assistant_reply_as_response(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                          {"role": "assistant", "content": "r"}]},
            {"prompt": [{"role": "user", "content": "q"}], "response": "a"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    a, b = load_prompts(f)
    assert a.messages == (("system", "s"), ("user", "u")) and a.response == "r"
    assert b.chat() == [{"role": "user", "content": "q"}] and b.response == "a"


def test_parquet_verl_layout(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"prompt": [[{"role": "user", "content": "x"}], [{"role": "user", "content": "y"}]],
                      "data_source": ["s", "s"]})
    pq.write_table(table, tmp_path / "p.parquet")
    recs = load_prompts(tmp_path / "p.parquet")
    assert [r.messages for r in recs] == [(("user", "x"),), (("user", "y"),)]


@pytest.mark.parametrize("name, content, message", [
    ("p.txt", "x", "unknown extension"),
    ("p.json", "{\"a\": 1}", "expected a list"),
    ("p.json", "[1]", "expected a string or an object"),
    ("p.json", "[\"\"]", "empty prompt"),
    ("p.jsonl", "{\"prompt\": \"a\"}\n{oops", "p.jsonl:2"),
    ("p.json", "[{\"messages\": [{\"role\": \"user\"}]}]", "string 'role' and 'content'"),
    ("p.json", "[{\"prompt\": \"a\", \"response\": 3}]", "'response' must be a string"),
    ("p.parquet", "not parquet", "not readable parquet"),
])
def test_errors_name_the_problem(tmp_path, name, content, message):
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_prompts(f)


def test_a_folder_or_a_file_not_utf8_is_named(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        load_prompts(tmp_path)
    f = tmp_path / "p.json"
    f.write_bytes(b'["caf\xe9"]')  # Latin-1
    with pytest.raises(ValueError, match=r"p\.json is not UTF-8 text"):
        load_prompts(f)
