"""downstream/prompts.py: few-shot prompts (one seeded draw per task, the same for every example, step and rank
count), their exact text, and lm-evaluation-harness's context/continuation split."""
from __future__ import annotations

import json
from pathlib import Path

from downstream.config import DownstreamConfig, TaskConfig
from downstream.evaluate import prepare_tasks
from downstream.prompts import encode_pair, fewshot_examples, prompt
from downstream.tasks import load_task

TRAIN = [{"context": f"Question: {q}\nAnswer:", "choices": [a, "no idea"], "gold": 0, "split": "train"}
         for q, a in [("What is 1+1?", "2"), ("空は何色？", "青"), ("Which animal says meow?", "a cat"),
                      ("富士山はどこ？", "日本"), ("What do bees make?", "honey"), ("猫の鳴き声は？", "にゃー")]]
TEST = [{"context": f"Question: {q}\nAnswer:", "choices": [a, b], "gold": 0}
        for q, a, b in [("What is 2+2?", "4", "5"), ("雨の日に使うものは？", "傘", "靴"),
                        ("Where is Tokyo?", "Japan", "Peru")]]


def write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    return path


def prepare(tokenizer, task: TaskConfig, **cfg):
    return prepare_tasks(DownstreamConfig(tasks=[task], **cfg), tokenizer, 512, tokenizer.bos_id, tokenizer.eod_id)


def test_every_example_gets_the_same_few_shot_examples(tmp_path, tokenizer):
    path = write_lines(tmp_path / "qa.jsonl", TRAIN + TEST)
    [prepared] = prepare(tokenizer, TaskConfig(path=str(path), num_fewshot=2), prefix="none")
    prompts = [tokenizer.decode(requests[0].context) for requests in prepared.loglik]
    shots = {text.rsplit("\n\n", 1)[0] for text in prompts}
    assert len(shots) == 1  # one block of solved examples before every question
    block = shots.pop().split("\n\n")
    solved = {f"{line['context']} {line['choices'][0]}" for line in TRAIN}
    assert len(block) == 2 and set(block) <= solved
    assert [text.rsplit("\n\n", 1)[1] for text in prompts] == [line["context"] for line in TEST]


def test_the_few_shot_draw_depends_on_the_seed_and_name_only(tmp_path):
    path = write_lines(tmp_path / "qa.jsonl", TRAIN + TEST)
    task = load_task(TaskConfig(path=str(path), num_fewshot=2))
    draw = [shot.context for shot in fewshot_examples(task, 1234)]
    # Pinned: a str seed is hashed by random.Random itself (sha512), never by the per-process hash(), so another
    # process, step or rank count draws these same two; a change here changes every few-shot score.
    assert draw == [TRAIN[4]["context"], TRAIN[5]["context"]]
    assert [s.context for s in fewshot_examples(load_task(TaskConfig(path=str(path), num_fewshot=2, max_examples=1)),
                                                1234)] == draw  # not moved by how many examples are scored
    others = {tuple(s.context for s in fewshot_examples(task, seed)) for seed in range(6)}
    assert len(others) > 1  # the seed does choose


def test_a_one_shot_prompt_is_exactly_instruction_shot_and_question(tmp_path, tokenizer):
    path = write_lines(tmp_path / "mc.jsonl", [TRAIN[1], TEST[1]])
    task_cfg = TaskConfig(path=str(path), num_fewshot=1, instruction="Answer in one word.")
    task = load_task(task_cfg)
    expected = "Answer in one word.\n\nQuestion: 空は何色？\nAnswer: 青\n\nQuestion: 雨の日に使うものは？\nAnswer:"
    assert prompt(task, task.examples[0], fewshot_examples(task, 1234)) == expected
    [prepared] = prepare(tokenizer, task_cfg)  # prefix=eos: the end-of-document token, then the prompt
    for request, choice in zip(prepared.loglik[0], ["傘", "靴"]):
        assert request.context[0] == tokenizer.eod_id
        assert tokenizer.decode(request.context[1:] + request.continuation) == f"{expected} {choice}"


def test_a_qa_prompt_ends_with_the_newline_delimiter(tmp_path, tokenizer):
    lines = [{"context": "Q: 1+1?", "answer": "2", "split": "train"}, {"context": "Q: 2+3?", "answer": "5"}]
    [prepared] = prepare(tokenizer, TaskConfig(path=str(write_lines(tmp_path / "qa.jsonl", lines)), num_fewshot=1),
                         prefix="none")
    assert tokenizer.decode(prepared.generate[0].context) == "Q: 1+1?\n2\n\nQ: 2+3?\n"


def test_encode_pair_moves_trailing_whitespace_to_the_continuation(tokenizer):
    context, continuation = encode_pair(tokenizer, "Question: Which city?\nAnswer: ", "Tokyo")
    assert context == tokenizer.encode("Question: Which city?\nAnswer:")
    assert continuation == tokenizer.encode("Question: Which city?\nAnswer: Tokyo")[len(context):]
    assert tokenizer.decode(continuation) == " Tokyo"
    assert tokenizer.decode(continuation[:1]).startswith(" ")  # the word's first piece carries its space
    # a newline moves too; without trailing whitespace the split is the plain one
    assert tokenizer.decode(encode_pair(tokenizer, "吾輩は猫である。\n", "名前")[1]) == "\n名前"
    assert encode_pair(tokenizer, "吾輩は", "猫") == (tokenizer.encode("吾輩は"),
                                                  tokenizer.encode("吾輩は猫")[len(tokenizer.encode("吾輩は")):])
