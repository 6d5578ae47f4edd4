"""Bad configuration: every field has a type and a range, unknown keys get a suggestion, TOML errors name the file
and line, and everything checkable before spawning (layout against the model, batch divisibility, schedule,
positions, the --base / --resume files) is checked before any rank starts.

Each case: exit status 2, one line `tpzoo <command>: error: ...` naming the file / field / line, no traceback,
the inputs untouched, and no rank started (tpzoo.commands.launch.run_multirank is replaced: see
preflight_helpers). Most run tpzoo.cli.main in this process (milliseconds); a few run a real process.
"""
import json

import pytest

from preflight_helpers import cli, cli_process, hf_config_dir, hf_gpt2, one_error_line  # noqa: F401

pytestmark = pytest.mark.faults


def toml(tmp_path, text: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


# -- one field at a time: type and range -----------------------------------------------------------------------

RANGE_CASES = [  # (TOML line, what the error says): every class of range the fields have
    ("lr = -0.01", "lr must be >= 0, got -0.01"),
    ("beta1 = 1.0", "beta1 must be in [0, 1), got 1.0"),
    ("beta2 = -0.5", "beta2 must be in [0, 1), got -0.5"),
    ("eps = 0.0", "eps must be > 0, got 0.0"),
    ("steps = 0", "steps must be >= 1, got 0"),
    ("global_batch_size = 0", "global_batch_size must be >= 1, got 0"),
    ("micro_batch_size = -2", "micro_batch_size must be >= 1, got -2"),
    ("clip_grad = -1.0", "clip_grad must be >= 0, got -1.0"),
    ("warmup_steps = -5", "warmup_steps must be >= 0, got -5"),
    ("label_smoothing = 1.0", "label_smoothing must be in [0, 1), got 1.0"),
    ("eval_fraction = 1.0", "eval_fraction must be in [0, 1), got 1.0"),
    ("weight_decay = -0.1", "weight_decay must be >= 0, got -0.1"),
    ("tp = 0", "tp must be >= 1, got 0"),
    ("zero = 4", "zero must be in [0, 3], got 4"),
    ("dist_timeout = 0", "dist_timeout must be > 0, got 0.0"),
    ("lr = nan", "lr: expected a finite number, got nan"),
    ("inject_nan_steps = [0]", "inject_nan_steps must be >= 1, got 0"),
    ('text_field = ""', "text_field must not be empty"),
]


@pytest.mark.parametrize("line,says", RANGE_CASES, ids=[c[0].split(" =")[0] + "-" + str(i)
                                                         for i, c in enumerate(RANGE_CASES)])
def test_a_value_out_of_range_names_file_line_field_and_range(tmp_path, monkeypatch, capsys, line, says):
    path = toml(tmp_path, f"# a run\n{line}\n")
    one_error_line(*cli(monkeypatch, capsys, "pretrain", path), "pretrain", f"{path}:2: {says}")


def test_a_flag_out_of_range_names_the_flag(monkeypatch, capsys):
    one_error_line(*cli(monkeypatch, capsys, "pretrain", "--lr", "-0.01"), "pretrain", "--lr: lr must be >= 0")
    one_error_line(*cli(monkeypatch, capsys, "finetune", "--base", "x", "--beta1", "1"), "finetune",
                   "--beta1: beta1 must be in [0, 1), got 1.0")


def test_a_string_for_a_number_names_field_value_and_type_in_a_real_process(tmp_path):
    path = toml(tmp_path, '[optim]\nlr = "fast"\n')
    one_error_line(*cli_process("pretrain", path, cwd=tmp_path), "pretrain",
                   f"{path}:2: lr: expected a number (float), got 'fast' (str)")


@pytest.mark.parametrize("line,says", [
    ("tp = 2.5", "tp: expected an integer, got 2.5 (float)"),
    ('sequence_parallel = "maybe"', "sequence_parallel: expected a boolean (true or false), got 'maybe' (str)"),
    ("data = [3]", "data: expected a string, got 3 (int)"),
    ('dtype = "fp8"', "dtype must be one of ('fp32', 'bf16', 'fp16'), got 'fp8'"),
])
def test_a_wrong_type_names_field_value_and_type(tmp_path, monkeypatch, capsys, line, says):
    path = toml(tmp_path, f"{line}\n")
    one_error_line(*cli(monkeypatch, capsys, "pretrain", path), "pretrain", f"{path}:1: {says}")


# -- keys and TOML syntax ----------------------------------------------------------------------------------------

def test_an_unknown_key_suggests_the_field(tmp_path, monkeypatch, capsys):
    path = toml(tmp_path, "seed = 1\nlearning_rate = 0.1\n")
    one_error_line(*cli(monkeypatch, capsys, "pretrain", path), "pretrain",
                   f"{path}:2: unknown config key 'learning_rate' (did you mean 'lr'?)")


def test_an_unknown_key_in_a_section_names_the_section_and_suggests(tmp_path, monkeypatch, capsys):
    path = toml(tmp_path, "[optim]\nlr = 0.1\nwarmup_stesp = 3\n")
    one_error_line(*cli(monkeypatch, capsys, "pretrain", path), "pretrain",
                   f"{path}:3: [optim] has no key 'warmup_stesp' (did you mean 'warmup_steps'?)")
    path.write_text("[optim]\ntp = 2\n")  # a real key, in the wrong section
    one_error_line(*cli(monkeypatch, capsys, "pretrain", path), "pretrain",
                   f"{path}:2: [optim] has no key 'tp' (it belongs in [parallel])")
    path.write_text("[optimizer]\nlr = 0.1\n")
    one_error_line(*cli(monkeypatch, capsys, "pretrain", path), "pretrain",
                   f"{path}:1: unknown section [optimizer] (did you mean [optim]?)")


def test_invalid_toml_names_the_file_and_line_in_a_real_process(tmp_path):
    path = toml(tmp_path, "[optim]\nlr = 0.1\nbeta1 0.9\n")
    one_error_line(*cli_process("pretrain", path, cwd=tmp_path), "pretrain", f"{path}:3:7: invalid TOML: Expected '='")


def test_a_missing_or_non_utf8_config_file_is_named(tmp_path, monkeypatch, capsys):
    one_error_line(*cli(monkeypatch, capsys, "pretrain", tmp_path / "nope.toml"), "pretrain",
                   f"config file not found: {tmp_path / 'nope.toml'}")
    path = tmp_path / "latin1.toml"
    path.write_bytes("seed = 1\n# caf\xe9\n".encode("latin-1"))
    one_error_line(*cli(monkeypatch, capsys, "pretrain", path), "pretrain",
                   f"{path}:2: not UTF-8 text (invalid byte 0xe9 at byte offset 14)")


# -- combinations and the model: checked before any rank starts ------------------------------------------------

@pytest.mark.parametrize("flags,says", [
    (["--tp", "3"], "model tiny-gpt: tp=3 does not divide num_heads=4"),
    (["--global-batch-size", "10", "--micro-batch-size", "4"],
     "global_batch_size 10 is not a multiple of micro_batch_size 4 x dp 1 = 4"),
    (["--tp", "1", "--dp", "2", "--global-batch-size", "12", "--micro-batch-size", "4"],
     "global_batch_size 12 is not a multiple of micro_batch_size 4 x dp 2 = 8"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], "min_lr 0.01 is above lr 0.001"),
    (["--sequence-parallel", "--seq-len", "255"], "sequence_parallel: seq_len 255 is not divisible by tp=2"),
    (["--tp", "1", "--pp", "2", "--virtual-stages", "2"], "virtual_stages=2 needs schedule = 'interleaved'"),
    (["--tp", "1", "--pp", "2", "--virtual-stages", "2", "--schedule", "interleaved", "--global-batch-size", "24"],
     "needs the micro-batches per step (global_batch_size / (micro_batch_size * dp) = 3) to be a multiple of pp=2"),
    (["--tp", "1", "--pp", "2", "--pp-boundaries", "0,4"],
     "pp_boundaries [0, 4] needs pp * virtual_stages + 1 = 3 entries"),
    (["--tp", "1", "--pp", "2", "--pp-boundaries", "0,4,4"],
     "model tiny-gpt: boundaries [0, 4, 4]: stage 1 would be empty ([4, 4))"),
    (["--seq-len", "512"], "model tiny-gpt: seq_len 512 exceeds the model's max_position_embeddings 256"),
    (["--model", "tiny-gtp"], "unknown model 'tiny-gtp' (did you mean 'tiny-gpt'?)"),
    (["--zero", "3", "--base", "b", "--lora-rank", "4"], "--zero 3 with LoRA: the frozen base is not sharded"),
    (["--zero", "2", "--zero3-gather-per-step"], "zero3_gather_per_step needs --zero 3 (zero = 2)"),
    (["--zero", "2", "--zero1"], "zero1 = true is --zero 1, but zero = 2 is also set: keep one of them"),
    (["--cp", "3", "--seq-len", "4"], "cp=3 cuts every sequence into 2*cp = 6 chunks, more than seq_len 4 tokens"),
    (["--cp", "4", "--cp-mode", "a2a"], "model tiny-gpt: --cp-mode a2a needs the 2 heads per TP rank (num_heads 4 / "
                                        "tp 2) divisible by cp=4"),
    (["--device", "cuda:0"] if not __import__("torch").cuda.is_available() else ["--device", "tpu"], "device "),
])
def test_a_combination_that_cannot_run_fails_before_spawning(monkeypatch, capsys, tmp_path, flags, says):
    monkeypatch.chdir(tmp_path)
    one_error_line(*cli(monkeypatch, capsys, "pretrain", *flags), "pretrain", says)


def test_pp_8_on_a_4_layer_model_fails_before_spawning_in_a_real_process(tmp_path):
    one_error_line(*cli_process("pretrain", "--tp", "1", "--pp", "8", cwd=tmp_path), "pretrain",
                   "model tiny-gpt: 4 layers cannot fill 8 pipeline stages (pp=8 x virtual_stages=1)")


def test_tp_3_on_4_heads_fails_before_spawning_in_a_real_process(tmp_path):
    one_error_line(*cli_process("pretrain", "--tp", "3", cwd=tmp_path), "pretrain",
                   "tp=3 does not divide num_heads=4")


def test_kv_heads_that_tp_cannot_split_fail_before_spawning(tmp_path, monkeypatch, capsys):
    base = hf_config_dir(tmp_path / "base", hidden_size=96, num_attention_heads=12, num_key_value_heads=4,
                         intermediate_size=96)
    one_error_line(*cli(monkeypatch, capsys, "pretrain", "--base", base, "--tp", "6"), "pretrain",
                   f"--base {base}: tp=6 neither divides nor is a multiple of num_kv_heads=4")


def test_what_the_trainer_refuses_of_a_kind_the_preflight_refuses(monkeypatch, capsys):
    """The preflight resolves the run's model by the trainer's own rules (tpzoo/train/run_model.py) and asks every
    layer kind of it: a Gated DeltaNet whose key heads tp does not divide (the kind's own check; the attention
    and MLP of the model split at tp=4), and the sequence-wise auxiliary loss asked of a model whose kinds have no
    sigmoid router (the MoE kind's run settings), fail before any rank starts."""
    one_error_line(*cli(monkeypatch, capsys, "pretrain", "--model", "nano-qwen3.5", "--tp", "4"), "pretrain",
                   "model nano-qwen3.5: tp=4 does not divide linear_num_key_heads=2")
    one_error_line(*cli(monkeypatch, capsys, "pretrain", "--model", "tiny-llama", "--router-aux-loss-coef", "0.01"),
                   "pretrain", "--router-aux-loss-coef 0.01: the sequence-wise auxiliary loss is the sigmoid router's")


def test_the_world_size_under_torchrun_is_checked_before_the_process_groups(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    from tpzoo.cli import main

    rc = main(["pretrain", "--tp", "2"])  # the rank's own preflight: a ConfigError before init_parallel
    one_error_line(rc, capsys.readouterr().err, "pretrain", "world size 3 is not divisible by tp*pp*cp = 2*1*1 = 2")
    monkeypatch.setenv("WORLD_SIZE", "6")
    rc = main(["pretrain", "--tp", "2", "--cp", "2"])
    one_error_line(rc, capsys.readouterr().err, "pretrain", "world size 6 is not divisible by tp*pp*cp = 2*1*2 = 4")


def test_a_valid_config_passes_preflight_and_reaches_the_ranks(monkeypatch, tmp_path):
    import tpzoo.commands.launch as launch
    from tpzoo.cli import main

    monkeypatch.chdir(tmp_path)
    started = []
    monkeypatch.setattr(launch, "run_multirank", lambda fn, args, nproc, cmd: started.append((nproc, cmd)) or 0)
    assert main(["pretrain", "--steps", "3"]) == 0
    assert main(["pretrain", "--tp", "1", "--pp", "2", "--dp", "2", "--micro-batch-size", "4", "--virtual-stages", "2",
                 "--schedule", "interleaved"]) == 0
    assert main(["pretrain", "--cp", "2", "--seq-len", "30"]) == 0  # padded to whole chunks
    assert started == [(2, "pretrain"), (4, "pretrain"), (4, "pretrain")]


def test_config_schedule_names_are_the_pipelines():
    from tpzoo.pipeline import SCHEDULES
    from tpzoo.train.config import SCHEDULE_NAMES

    assert set(SCHEDULE_NAMES) == set(SCHEDULES)


# -- files behind --base and --resume ----------------------------------------------------------------------------

def test_an_invalid_hf_config_json_in_base_names_the_file_in_a_real_process(tmp_path):
    base = hf_config_dir(tmp_path / "base")
    (base / "config.json").write_text('{"model_type": "llama",\n}\n')
    one_error_line(*cli_process("finetune", "--base", base, "--data", "x.jsonl", cwd=tmp_path), "finetune",
                   f"{base / 'config.json'}:2:1: invalid JSON in a Hugging Face config")


def test_a_hf_config_json_without_a_field_or_with_a_bad_value_names_file_and_field(tmp_path, monkeypatch, capsys):
    base = hf_config_dir(tmp_path / "base")
    data = json.loads((base / "config.json").read_text())
    del data["hidden_size"]
    (base / "config.json").write_text(json.dumps(data))
    one_error_line(*cli(monkeypatch, capsys, "finetune", "--base", base, "--data", "x.jsonl"), "finetune",
                   f"{base / 'config.json'}: missing field 'hidden_size'")
    hf_config_dir(base, num_attention_heads=0)
    one_error_line(*cli(monkeypatch, capsys, "finetune", "--base", base, "--data", "x.jsonl"), "finetune",
                   f"{base / 'config.json'}: num_heads must be a positive integer, got 0")


def test_a_missing_base_is_named(tmp_path, monkeypatch, capsys):
    one_error_line(*cli(monkeypatch, capsys, "finetune", "--base", tmp_path / "nope", "--data", "x.jsonl"),
                   "finetune", f"--base {tmp_path / 'nope'}: no such checkpoint or Hugging Face model directory")


def test_a_corrupt_train_state_json_on_resume_names_the_file(tmp_path, monkeypatch, capsys):
    ckpt = tmp_path / "run" / "step_00000010"
    ckpt.mkdir(parents=True)
    (ckpt / "train_state.json").write_text('{"format": "tpzoo-train-state", "step": 10,')
    one_error_line(*cli(monkeypatch, capsys, "pretrain", "--resume", ckpt), "pretrain",
                   str(ckpt / "train_state.json"), "corrupt")


def test_a_tokenizer_larger_than_the_base_vocabulary_fails_before_spawning(tmp_path, monkeypatch, capsys):
    base = hf_config_dir(tmp_path / "base", vocab_size=200)  # no tokenizer files: the byte tokenizer (259)
    one_error_line(*cli(monkeypatch, capsys, "finetune", "--base", base, "--data", "x.jsonl"), "finetune",
                   f"tokenizer byte has 259 tokens but model llama from --base {base} has a vocabulary of 200")


# -- eval and generate: the checkpoint against the layout, before spawning ---------------------------------------

def test_eval_with_tp_not_dividing_heads_fails_before_spawning_in_a_real_process(tmp_path, hf_gpt2):
    text = tmp_path / "t.txt"
    text.write_text("hello world\n")
    one_error_line(*cli_process("eval", hf_gpt2, "--text-file", text, "--tp", "3", cwd=tmp_path), "eval",
                   f"checkpoint {hf_gpt2}: tp=3 does not divide num_heads=4")


def test_generate_layout_and_sampling_values_fail_before_spawning(monkeypatch, capsys, hf_gpt2):
    args = ("generate", hf_gpt2, "--prompt", "hi")
    one_error_line(*cli(monkeypatch, capsys, *args, "--tp", "3"), "generate", "tp=3 does not divide num_heads=4")
    one_error_line(*cli(monkeypatch, capsys, *args, "--pp", "3"), "generate",
                   "2 layers cannot fill 3 pipeline stages")
    one_error_line(*cli(monkeypatch, capsys, *args, "--top-p", "0"), "generate", "--top-p must be in (0, 1], got 0.0")
    one_error_line(*cli(monkeypatch, capsys, *args, "--temperature", "0"), "generate",
                   "--temperature must be > 0, got 0.0 (for argmax decoding use --greedy)")


def test_eval_seq_len_beyond_learned_positions_fails_before_spawning(tmp_path, monkeypatch, capsys, hf_gpt2):
    text = tmp_path / "t.txt"
    text.write_text("hello world\n")
    one_error_line(*cli(monkeypatch, capsys, "eval", hf_gpt2, "--text-file", text, "--seq-len", "512"), "eval",
                   "seq_len 512 exceeds the model's max_position_embeddings 128")
    one_error_line(*cli(monkeypatch, capsys, "eval", hf_gpt2, "--text-file", text, "--batch-size", "0"), "eval",
                   "--batch-size must be >= 1, got 0")
    one_error_line(*cli(monkeypatch, capsys, "eval", hf_gpt2, "--text-file", text, "--cp", "8", "--cp-mode", "a2a"),
                   "eval", f"checkpoint {hf_gpt2}: --cp-mode a2a needs the 4 heads per TP rank (num_heads 4 / tp 1) "
                           f"divisible by cp=8")
