"""`dflash-ring eval`'s baselines, prompt rows and progress: prompt lookup drafts the continuation of the last matching
n-gram and its decoding is lossless (greedy: the target's greedy decode; T = 1: the target's distribution); the
untrained baseline is `make run`'s untrained drafter, really decoded; prompt-only rows give the prompts of the same
rows with replies (regenerate's rule); the CLI reports progress on stderr and keeps --json's stdout clean."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import asdict

import pytest
import torch

from dflash_ring.cli import _parser, main
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.evaluation import evaluate
from dflash_ring.consumer.evaluation.evaluate import (
    BASELINES,
    EvalProgress,
    EvalRefusal,
    chat_prompts,
    drafter_draft_fn,
    evaluate_drafter,
    format_progress,
    format_report,
    progress_logger,
    prompt_generators,
    prompt_lookup_draft_fn,
    speculative_generate,
    untrained_drafter,
)
from dflash_ring.consumer.layouts.export import export_drafter, load_drafter
from dflash_ring.consumer.families.build import build_drafter
from dflash_ring.consumer.evaluation.prompt_lookup import prompt_lookup
from support import (  # noqa: F401 (fixtures, asked for by name)
    EVAL_VOCAB,
    MICRO_VOCAB,
    chi2_bound,
    exact_joint,
    load_tokenizer,
    micro_target,
    pearson,
    plain_greedy,
    target,
    target_dir,
)

BLOCK, MAX_NEW, LAYER_IDS, VOCAB = 4, 24, [1, 2], EVAL_VOCAB
# Prompts that repeat themselves, so n-grams match from the first round on.
PROMPTS = ([5, 17, 42, 9, 5, 17, 42, 9, 5, 17], [3, 3, 3], [60, 61, 62, 70, 60, 61, 80, 60, 61])
ROWS = [
    {"messages": [{"role": "user", "content": "Count from 3 to 7."}, {"role": "assistant", "content": "3 4"}]},
    {"prompt": "Repeat: red cat, red cat.", "response": "red cat"},
]


def drafter_config() -> DrafterConfig:
    return DrafterConfig(
        num_hidden_layers=2, block_size=BLOCK, loss_gamma=2.0, mask_token_id=VOCAB - 1, target_layer_ids=LAYER_IDS
    )


@pytest.fixture(scope="module")
def drafter_dir(target_dir, tmp_path_factory):
    torch.manual_seed(1)
    config = json.loads((target_dir / "config.json").read_text())
    return export_drafter(
        build_drafter(drafter_config(), config), drafter_config(), config, tmp_path_factory.mktemp("d") / "drafter"
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "heldout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


# --- prompt lookup ---------------------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_last_match_of_the_longest_suffix():
    # [1, 2, 3] occurred at 0 (then 9, 9) and at 5 (then 7, 8): the last one's continuation.
    seq = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert prompt_lookup(seq, max_ngram=3, max_tokens=4) == [7, 8, 1, 2]
    assert prompt_lookup(seq, max_ngram=3, max_tokens=1) == [7]
    # No earlier [4, 2, 3]: the 2-gram [2, 3] matches (its last occurrence is at 6, followed by 7, 8, ...).
    assert prompt_lookup([*seq[:-3], 4, 2, 3], max_ngram=3, max_tokens=2) == [7, 8]
    # max_ngram 1: the last earlier 3 (at 7), whatever precedes it.
    assert prompt_lookup([1, 2, 3, 5, 6, 3, 7, 0, 3], max_ngram=1, max_tokens=3) == [7, 0, 3]
    # A longer n-gram wins over a later shorter one: [5, 6] at 0 (then 1), though 6 alone occurred last at 4 (then 2).
    assert prompt_lookup([5, 6, 1, 0, 6, 2, 5, 6], max_ngram=2, max_tokens=1) == [1]
    # The occurrence may overlap the suffix; the continuation stops at the end of the sequence.
    assert prompt_lookup([1, 2, 1, 2, 1], max_ngram=3, max_tokens=5) == [2, 1]
    assert prompt_lookup([7, 7], max_ngram=3, max_tokens=4) == [7]


@pytest.mark.parametrize("seq", [[], [4], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]], ids=str)
def test_prompt_lookup_without_a_match_proposes_nothing(seq):
    assert prompt_lookup(seq, max_ngram=3, max_tokens=4) == []


@pytest.mark.parametrize("prompt", PROMPTS, ids=str)
@pytest.mark.parametrize("tokens", [BLOCK - 1, 8])
def test_prompt_lookup_decoding_equals_plain_greedy(target, prompt, tokens):
    """The output is the target's greedy decode, and each round accepted exactly the lookup's drafts that the greedy
    decode goes on with (their common prefix), replayed from the rounds' counts."""
    got = speculative_generate(
        target,
        prompt,
        prompt_lookup_draft_fn(max_ngram=3, max_tokens=tokens),
        block_size=tokens + 1,
        target_layer_ids=[],
        num_drafts=tokens,
        eos_token_ids=(),
        max_new_tokens=MAX_NEW,
        fewer_drafts=True,
    )
    greedy = plain_greedy(target, prompt, MAX_NEW + tokens + 1)
    assert got.tokens == greedy[:MAX_NEW]
    assert len(got.tokens) == min(MAX_NEW, 1 + sum(n + 1 for n in got.accepted))
    committed = 1  # the prefill's token
    for n in got.accepted:
        drafts = prompt_lookup(prompt + greedy[:committed], max_ngram=3, max_tokens=tokens)
        matching = next((k for k, (d, t) in enumerate(zip(drafts, greedy[committed:])) if d != t), len(drafts))
        assert n == matching, (got.accepted, committed)
        committed += n + 1


def test_prompt_lookup_drafts_are_accepted(target):
    """The repeating prompts send this target into repeats too, so the replay above checks counts that are not all
    zero (measured: drafts accepted for every prompt)."""
    for prompt in PROMPTS:
        got = speculative_generate(
            target,
            prompt,
            prompt_lookup_draft_fn(max_ngram=3, max_tokens=BLOCK - 1),
            block_size=BLOCK,
            target_layer_ids=[],
            num_drafts=BLOCK - 1,
            eos_token_ids=(),
            max_new_tokens=MAX_NEW,
            fewer_drafts=True,
        )
        assert sum(got.accepted) > 0, (prompt, got.accepted)


def test_a_drafter_that_drafts_fewer_is_refused_unless_allowed(target):
    """A neural drafter that returned a short block would lower tau unseen: only prompt lookup may."""
    short = prompt_lookup_draft_fn(max_ngram=3, max_tokens=BLOCK - 1)
    kw = dict(block_size=BLOCK, target_layer_ids=[], num_drafts=BLOCK - 1, eos_token_ids=(), max_new_tokens=8)
    with pytest.raises(ValueError, match=r"draft returned shape \(0,\), expected \(3,\)"):
        speculative_generate(target, [1, 2, 3, 4], short, **kw)
    with pytest.raises(ValueError, match=r"expected at most \(2,\)"):
        speculative_generate(
            target,
            [1, 2, 3],
            lambda committed, context: torch.tensor([1, 2, 3]),
            **{**kw, "num_drafts": 2},
            fewer_drafts=True,
        )


MICRO_NEW, MICRO_RUNS = 4, 400
MICRO_PROMPT = [0, 1, 2, 1, 0, 1]


def micro_counts(target, draft_for) -> tuple[Counter, list[int]]:
    counts, accepted = Counter(), []
    for g in prompt_generators(0, MICRO_RUNS, "cpu"):
        got = speculative_generate(
            target,
            MICRO_PROMPT,
            draft_for(g),
            block_size=4,
            num_drafts=3,
            target_layer_ids=[],
            eos_token_ids=(),
            max_new_tokens=MICRO_NEW,
            temperature=1.0,
            generator=g,
            fewer_drafts=True,
        )
        counts[tuple(got.tokens)] += 1
        accepted += got.accepted
    return counts, accepted


def test_sampled_prompt_lookup_is_lossless(micro_target):
    """Prompt lookup at T = 1: its point-mass drafts verified by speculative sampling give the target's distribution
    of the first four tokens (Pearson's chi-square under the p = 0.001 bound, as test_dspark_eval's drafters). With
    three tokens the lookup drafts in nearly every round; the same runs with the drafts taken for certain (q = p at
    the draft, so always accepted) are far above the bound: the harness catches a wrong q."""
    exact = exact_joint(micro_target, MICRO_PROMPT, MICRO_NEW)
    lookup = prompt_lookup_draft_fn(max_ngram=3, max_tokens=3, temperature=1.0, vocab_size=MICRO_VOCAB)
    counts, accepted = micro_counts(micro_target, lambda g: lookup)
    stat, df = pearson(counts, exact, MICRO_RUNS)
    assert stat < chi2_bound(df), (stat, df)
    assert sum(n > 0 for n in accepted) > len(accepted) / 10  # drafts were accepted: the rule was exercised

    def always_accepted(committed, context):
        """Wrong: claims q(x) = 0 < p(x) (rows of zeros), so every draft passes u * q < p."""
        proposal = lookup(committed, context)
        return evaluate.Draft(proposal.tokens, probs=torch.zeros_like(proposal.probs))

    wrong, _ = micro_counts(micro_target, lambda g: always_accepted)
    stat, df = pearson(wrong, exact, MICRO_RUNS)
    assert stat > 2 * chi2_bound(df), (stat, df)


# --- the untrained baseline --------------------------------------------------------------------------


def test_untrained_drafter_is_make_run_s_untrained_drafter(drafter_dir, target_dir):
    """tools/launcher.py draws `make run`'s untrained drafter with torch.manual_seed(0) then build_drafter: the
    baseline is that drafter, whatever the global generator's state, which it leaves alone."""
    config = json.loads((target_dir / "config.json").read_text())
    torch.manual_seed(0)
    launcher = build_drafter(drafter_config(), config).state_dict()
    trained = load_drafter(drafter_dir, dtype=torch.float32)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    fresh = untrained_drafter(trained)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert type(fresh) is type(trained) and fresh.block_size == trained.block_size
    assert fresh.state_dict().keys() == launcher.keys()
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in launcher.items())
    assert not all(torch.equal(fresh.state_dict()[k], v) for k, v in trained.state_dict().items())


def test_baselines_are_decoded_beside_the_drafter(drafter_dir, target_dir, target, data):
    report = evaluate_drafter(
        drafter_dir, target_dir, data, max_new_tokens=12, baselines=["untrained", "prompt-lookup", "untrained"]
    )
    assert report.drafted_by == "drafter" and report.num_prompts == 2
    untrained, lookup = report.baselines
    assert (untrained.name, untrained.init_seed, untrained.drafts_per_round) == ("untrained", 0, BLOCK - 1)
    assert (lookup.name, lookup.lookup_ngram, lookup.drafts_per_round) == ("prompt-lookup", 3, BLOCK - 1)
    for row in report.baselines:
        # The same greedy decode as the drafter's chain (lossless), counted from rounds of its own drafts.
        assert row.same_tokens_as_chain == 2 and row.tokens_generated == report.tokens_generated
        assert row.rounds == sum(row.accepted_histogram) > 0 and len(row.accepted_histogram) == BLOCK
        assert 1 <= row.tau <= BLOCK

    # The untrained row is a real decode with the untrained drafter: its rounds, prompt by prompt.
    from dflash_ring.consumer.modeling.head_loader import load_target_head

    head = load_target_head(target_dir, dtype=torch.float32)
    fresh = untrained_drafter(load_drafter(drafter_dir, dtype=torch.float32))
    tokenizer = load_tokenizer(target_dir)
    taus = []
    for prompt in chat_prompts(data, tokenizer):
        got = speculative_generate(
            target,
            prompt,
            drafter_draft_fn(fresh, head),
            block_size=BLOCK,
            target_layer_ids=LAYER_IDS,
            eos_token_ids=evaluate.eos_ids(target, tokenizer),
            max_new_tokens=12,
        )
        taus.append(sum(n + 1 for n in got.accepted) / len(got.accepted))
    assert untrained.tau_per_prompt == pytest.approx(taus)

    text = format_report(report)
    assert "baselines on the same prompts, target and verification" in text
    assert "untrained (init seed 0)" in text and "prompt lookup (3-gram)" in text and "2/2" in text


def test_prompt_lookup_alone_needs_no_drafter(target_dir, data, capsys):
    args = ["eval", "--target", str(target_dir), "--data", str(data), "--max-new-tokens", "10"]
    assert main([*args, "--baseline", "prompt-lookup", "--lookup-tokens", "5", "--lookup-ngram", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["drafted_by"] == "prompt-lookup" and report["lookup_ngram"] == 2
    assert report["drafts_per_round"] == 5 and report["block_size"] == 6 and report["baselines"] == []
    assert len(report["accepted_histogram"]) == 6 and report["rounds"] == sum(report["accepted_histogram"]) > 0
    assert main([*args, "--baseline", "prompt-lookup", "--temperature", "1"]) == 0
    out = capsys.readouterr().out
    assert "prompt lookup: suffix n-grams of 3 down to 1 tokens, up to 10 drafts per round, temperature 1" in out


@pytest.mark.parametrize(
    "extra, says",
    [
        ([], "no drafter given (no baseline): give --drafter, or ask for --baseline prompt-lookup alone"),
        (["--baseline", "untrained"], "no drafter given (baselines untrained)"),
        (["--baseline", "prompt-lookup", "--tree-budget", "4"], "tree verification (tree budgets) drafts from"),
        (["--baseline", "prompt-lookup", "--lookup-tokens", "257"], "prompt lookup drafts 1..256 tokens a round"),
    ],
    ids=["nothing", "untrained", "trees", "lookup-tokens-huge"],
)
def test_without_a_drafter_only_prompt_lookup_runs_else_one_line(target_dir, data, capsys, extra, says):
    assert main(["eval", "--target", str(target_dir), "--data", str(data), *extra]) == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.strip()]
    assert line.startswith("dflash-ring eval: error: ") and says in line, err


def test_the_cli_offers_the_baselines_evaluate_knows():
    (eval_parser,) = [
        a.choices["eval"] for a in _parser()._actions if getattr(a, "choices", None) and "eval" in a.choices
    ]
    (option,) = [a for a in eval_parser._actions if "--baseline" in a.option_strings]
    assert tuple(option.choices) == BASELINES
    with pytest.raises(EvalRefusal, match="unknown baseline 'ngram'"):
        evaluate_drafter(None, "t", "d", baselines=["ngram"])


# --- prompt-only rows ----------------------------------------------------------------------------------


def test_prompt_only_rows_give_the_prompt_of_the_same_row_with_a_reply(target_dir, tmp_path):
    tokenizer = load_tokenizer(target_dir)
    user = {"role": "user", "content": "Count from 3 to 7."}
    reply = {"role": "assistant", "content": "3 4 5 6 7"}
    system = {"role": "system", "content": "Be brief."}
    rows = [
        {"prompt": "Count from 3 to 7."},
        {"prompt": "Count from 3 to 7.", "response": "3 4 5 6 7"},
        {"messages": [user]},
        {"messages": [user, reply]},
        {"messages": [system, user]},
        {"messages": [system, user, reply]},
        {"messages": [user, reply, user]},  # regenerate answers the last user turn: the whole chat
        {"messages": [user, reply, user, reply]},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = chat_prompts(path, tokenizer)
    assert prompts[0] == prompts[1] == prompts[2] == prompts[3]
    assert prompts[4] == prompts[5] != prompts[0]
    assert prompts[6] == prompts[7] != prompts[0]
    want = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert prompts[0] == tokenizer(want, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "row, says",
    [
        (
            {"messages": [{"role": "system", "content": "Be brief."}]},
            "line 2: the reply to regenerate follows a system",
        ),
        ({"response": "a reply to nothing"}, "line 2: 'prompt' is not a non-empty string"),
        ({"messages": []}, "line 2: empty conversation"),
    ],
    ids=["system-only", "response-only", "empty-chat"],
)
def test_a_row_with_no_prompt_is_still_refused(target_dir, tmp_path, row, says):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(EvalRefusal, match=says):
        chat_prompts(path, load_tokenizer(target_dir))


def test_eval_of_prompt_only_rows_regenerates_their_replies(drafter_dir, target_dir, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": r}) + "\n" for r in ("Count from 3 to 7.", "Repeat: red cat.")))
    report = evaluate_drafter(drafter_dir, target_dir, path, max_new_tokens=8)
    assert report.num_prompts == 2 and report.rounds > 0


# --- progress -------------------------------------------------------------------------------------------


def test_progress_is_reported_per_prompt_and_logged_first_last_and_between(drafter_dir, target_dir, data, caplog):
    seen: list[EvalProgress] = []
    evaluate_drafter(
        drafter_dir,
        target_dir,
        data,
        max_new_tokens=8,
        tree_budgets=[4],
        baselines=["prompt-lookup"],
        progress=seen.append,
    )
    assert [(p.decoder, p.done, p.total) for p in seen] == [
        (d, k, 2) for d in ("chain", "tree 4", "prompt-lookup") for k in (1, 2)
    ]
    assert [p.decodes_done for p in seen] == list(range(1, 7)) and {p.decodes_total for p in seen} == {6}
    assert all(p.tokens > 0 and p.tau >= 1 for p in seen) and seen[-1].eta_s == 0
    line = format_progress(EvalProgress("chain", 3, 100, 2.4123, 300, 2.0, 3, 300, 5.0))
    assert line == "chain: 3/100 prompts, tau 2.412, 150.0 target tokens/s, ETA 8m15s"

    caplog.set_level("INFO", logger="dflash_ring.consumer.evaluation.evaluate")
    nine = [
        EvalProgress(decoder, k, 9, 1.0, k, 1.0, k, 18, 1.0) for decoder in ("chain", "untrained") for k in range(1, 10)
    ]
    for interval, logged in ((3600, [1, 9, 1, 9]), (0, list(range(1, 10)) * 2)):
        caplog.clear()
        log = progress_logger(interval_s=interval)  # each decoder's first and last prompt, and any after the interval
        for p in nine:
            log(p)
        assert [int(r.getMessage().split(": ")[1].split("/")[0]) for r in caplog.records] == logged


@pytest.mark.processes
def test_the_cli_prints_progress_on_stderr_and_json_alone_on_stdout(drafter_dir, target_dir, data):
    """As a user runs it: its logging set up by cli.main, not pytest's capture (a process of its own)."""
    args = ["eval", "--drafter", drafter_dir, "--target", target_dir, "--data", data, "--max-new-tokens", "8"]
    done = subprocess.run(
        [sys.executable, "-m", "dflash_ring", *map(str, args), "--baseline", "untrained", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # stdout is the report alone
    assert [b["name"] for b in report["baselines"]] == ["untrained"]
    lines = [ln for ln in done.stderr.splitlines() if "dflash_ring.consumer.evaluation.evaluate:" in ln]
    assert any("chain: 1/2 prompts, tau " in ln and "target tokens/s, ETA " in ln for ln in lines), done.stderr
    assert any("chain: 2/2 prompts" in ln for ln in lines) and any("untrained: 2/2 prompts" in ln for ln in lines)
    assert (
        json.loads(
            json.dumps(
                asdict(evaluate_drafter(drafter_dir, target_dir, data, max_new_tokens=8, baselines=["untrained"]))
            )
        )
        == report
    )
