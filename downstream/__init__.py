"""Downstream evaluation: what a checkpoint can do, scored on task files, in the loop and after the fact.

- `config`: the `eval.downstream` section (tasks, interval, example cap, batch size, prefix, strictness);
- `tasks`: task files read and checked (ayumi's JSONL and llm-jp-eval's preprocessed JSON), one line per mistake;
- `prompts`: few-shot prompts and the token requests they become (log-likelihood or greedy generation);
- `metrics`: accuracy, length-normalised accuracy, exact match, character F1;
- `scoring`: a model's log-likelihoods and greedy continuations, batched, spread over data-parallel ranks;
- `evaluate`: all of it for a list of tasks, the scores a run logs and `ayumi eval` prints.

It knows nothing of DeepSpeed or of training: the model comes in as a function from token ids to logits, the
tokenizer as an object with `encode`/`decode`, and the ranks as a `Share` (rank, size, a sum over ranks),
so the trainer (pretrain/) and `ayumi eval` use it alike.

May import: `common` and torch; never pretrain/, DeepSpeed or W&B (the callers bring the model and the ranks).
"""
