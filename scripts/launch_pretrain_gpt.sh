#!/usr/bin/env bash
# scripts/launch_pretrain_gpt.sh: train GPT with upstream's pretrain_gpt.py on a Megatron-LM
# checkout that carries our series (scripts/apply_patches.sh), with the flags that exercise it:
#   --optimizer dist_muon --overlap-param-gather --overlap-grad-reduce --bf16
# (dist_muon is the layer-wise optimizer; --overlap-param-gather needs --overlap-grad-reduce;
#  muon forbids --use-distributed-optimizer: megatron/training/arguments.py, validate_args.)
#
# Usage: scripts/launch_pretrain_gpt.sh [OPTIONS] [MEGATRON_LM_DIR] [-- EXTRA_MEGATRON_ARGS...]
#
#   MEGATRON_LM_DIR          the checkout (holds pretrain_gpt.py); else $MEGATRON_LM
#   --fp32-grad-accum        add --accumulate-allreduce-grads-in-fp32: fp32 grad_data, bf16 params.
#                            (With --bf16, megatron-core 0.17.1 turns this on by itself unless
#                            grads are reduced in bf16; the flag makes the choice explicit.)
#   --bf16-grad-reduce       add --grad-reduce-in-bf16: bf16 grad_data, the same size as the params
#   --data-path PREFIX       indexed dataset prefix (repeatable, or "W1 P1 W2 P2"); default --mock-data
#   --mock-data              synthetic tokens (the default when no --data-path is given)
#   --split S                train/valid/test split for --data-path (default 949,50,1)
#   --tokenizer-type T       default: NullTokenizer (mock), GPT2BPETokenizer (--vocab-file),
#                            HuggingFaceTokenizer (--tokenizer-model)
#   --tokenizer-model PATH | --vocab-file PATH --merge-file PATH
#   --vocab-size N           NullTokenizer vocabulary (default 32768)
#   --num-layers N (4)  --hidden-size N (512)  --num-attention-heads N (8)  --seq-length N (1024)
#   --micro-batch-size N (2)  --global-batch-size N (micro x data-parallel size)
#   --train-iters N (100)  --lr X (3e-4)  --tp N (1)  --pp N (1)  --seed N (1234)
#   --save DIR  --load DIR  --tensorboard-dir DIR
#   --dry-run                print the environment and the full command, shell-quoted; run nothing
#   --allow-unpatched        launch even if scripts/apply_patches.sh --check does not say "applied"
#                            (an upstream baseline); by default that is an error
#   -h, --help
#   -- ARGS                  passed to pretrain_gpt.py unchanged, after ours (argparse: last wins)
#
# Environment (as torchrun/Slurm/Kubernetes launchers set them; defaults are one node):
#   NNODES (else SLURM_NNODES, else 1)      NODE_RANK (else SLURM_NODEID, else 0)
#   MASTER_ADDR (localhost)                 MASTER_PORT (6000)
#   GPUS_PER_NODE (else SLURM_GPUS_ON_NODE, else `nvidia-smi -L` count, else 1)
#   TORCHRUN (torchrun)                     MEGATRON_LM (checkout, if not given as argument)
#
# Before launching (also with --dry-run) the checkout is checked with scripts/apply_patches.sh --check.
#
# Exit: 0 ran (or printed, with --dry-run); 2 bad usage or input, or the series is not applied;
#       otherwise torchrun's exit code.
set -euo pipefail

PROG="launch_pretrain_gpt.sh"
die() { echo "$PROG: error: $*" >&2; exit 2; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
need_value() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value (see --help)"; }
is_posint() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }
is_nonneg() { [[ "$1" =~ ^(0|[1-9][0-9]*)$ ]]; }

# ---------------------------------------------------------------- options
checkout="" fp32_grad_accum=0 bf16_grad_reduce=0 dry_run=0 mock=0 allow_unpatched=0
data_paths=() split="949,50,1" tokenizer_type="" tokenizer_model="" vocab_file="" merge_file=""
vocab_size=32768 num_layers=4 hidden_size=512 heads=8 seq_length=1024 micro_batch=2
global_batch="" train_iters=100 lr=3e-4 tp=1 pp=1 seed=1234 save="" load="" tb_dir=""
extra=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --dry-run) dry_run=1 ;;
        --allow-unpatched) allow_unpatched=1 ;;
        --fp32-grad-accum|--accumulate-allreduce-grads-in-fp32) fp32_grad_accum=1 ;;
        --bf16-grad-reduce|--grad-reduce-in-bf16) bf16_grad_reduce=1 ;;
        --mock-data) mock=1 ;;
        --data-path) need_value "$@"; data_paths+=("$2"); shift ;;
        --split) need_value "$@"; split="$2"; shift ;;
        --tokenizer-type) need_value "$@"; tokenizer_type="$2"; shift ;;
        --tokenizer-model) need_value "$@"; tokenizer_model="$2"; shift ;;
        --vocab-file) need_value "$@"; vocab_file="$2"; shift ;;
        --merge-file) need_value "$@"; merge_file="$2"; shift ;;
        --vocab-size) need_value "$@"; vocab_size="$2"; shift ;;
        --num-layers) need_value "$@"; num_layers="$2"; shift ;;
        --hidden-size) need_value "$@"; hidden_size="$2"; shift ;;
        --num-attention-heads) need_value "$@"; heads="$2"; shift ;;
        --seq-length) need_value "$@"; seq_length="$2"; shift ;;
        --micro-batch-size) need_value "$@"; micro_batch="$2"; shift ;;
        --global-batch-size) need_value "$@"; global_batch="$2"; shift ;;
        --train-iters) need_value "$@"; train_iters="$2"; shift ;;
        --lr) need_value "$@"; lr="$2"; shift ;;
        --tp) need_value "$@"; tp="$2"; shift ;;
        --pp) need_value "$@"; pp="$2"; shift ;;
        --seed) need_value "$@"; seed="$2"; shift ;;
        --save) need_value "$@"; save="$2"; shift ;;
        --load) need_value "$@"; load="$2"; shift ;;
        --tensorboard-dir) need_value "$@"; tb_dir="$2"; shift ;;
        --) shift; extra=("$@"); break ;;
        -*) die "unknown option '$1' (megatron flags go after '--'; see --help)" ;;
        *)  [[ -z "$checkout" ]] || die "more than one checkout given ('$checkout', '$1')"
            checkout="$1" ;;
    esac
    shift
done

# ---------------------------------------------------------------- checks
checkout="${checkout:-${MEGATRON_LM:-}}"
[[ -n "$checkout" ]] || die "no Megatron-LM checkout: pass its path or set MEGATRON_LM"
[[ -d "$checkout" ]] || die "Megatron-LM checkout '$checkout' does not exist"
[[ -f "$checkout/pretrain_gpt.py" ]] \
    || die "'$checkout' has no pretrain_gpt.py: pass the root of a Megatron-LM checkout (git clone --branch core_v0.17.1)"
[[ -d "$checkout/megatron/core" ]] || die "'$checkout' has no megatron/core: not a Megatron-LM checkout"
checkout="$(cd "$checkout" && pwd)"

# Is the series in? apply_patches.sh --check: 0 applied, 3 not applied, 4 partly/foreign, 5 wrong base.
apply="$(dirname "${BASH_SOURCE[0]}")/apply_patches.sh"
series_rc=0
series_msg="$(bash "$apply" "$checkout" --check 2>&1)" || series_rc=$?
if [[ $series_rc != 0 ]]; then
    [[ $allow_unpatched == 1 ]] \
        || die "the series is not applied to '$checkout' (apply_patches.sh --check exit $series_rc: ${series_msg}); run scripts/apply_patches.sh '$checkout', or pass --allow-unpatched for an upstream baseline"
    echo "$PROG: warning: ${series_msg} (--allow-unpatched: launching anyway)" >&2
fi

nnodes="${NNODES:-${SLURM_NNODES:-1}}"
node_rank="${NODE_RANK:-${SLURM_NODEID:-0}}"
master_addr="${MASTER_ADDR:-localhost}"
master_port="${MASTER_PORT:-6000}"
if [[ -n "${GPUS_PER_NODE:-}" ]]; then gpus="$GPUS_PER_NODE"
elif [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then gpus="$SLURM_GPUS_ON_NODE"
elif command -v nvidia-smi >/dev/null 2>&1 && n="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" && [[ "$n" -gt 0 ]]; then gpus="$n"
else gpus=1
fi
torchrun_bin="${TORCHRUN:-torchrun}"

is_posint "$nnodes" || die "NNODES must be a positive integer, got '$nnodes'"
is_nonneg "$node_rank" || die "NODE_RANK must be a non-negative integer, got '$node_rank'"
(( node_rank < nnodes )) || die "NODE_RANK ($node_rank) must be less than NNODES ($nnodes)"
is_posint "$gpus" || die "GPUS_PER_NODE must be a positive integer, got '$gpus'"
[[ "$master_port" =~ ^[0-9]+$ ]] && (( master_port > 0 && master_port < 65536 )) \
    || die "MASTER_PORT must be a port number (1-65535), got '$master_port'"
[[ -n "$master_addr" && "$master_addr" != *[[:space:]]* ]] || die "MASTER_ADDR must be a host name or address, got '$master_addr'"
for pair in "vocab-size:$vocab_size" "num-layers:$num_layers" "hidden-size:$hidden_size" \
            "num-attention-heads:$heads" "seq-length:$seq_length" "micro-batch-size:$micro_batch" \
            "train-iters:$train_iters" "tp:$tp" "pp:$pp"; do
    is_posint "${pair#*:}" || die "--${pair%%:*} must be a positive integer, got '${pair#*:}'"
done
is_nonneg "$seed" || die "--seed must be a non-negative integer, got '$seed'"
[[ "$lr" =~ ^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$ ]] || die "--lr must be a number, got '$lr'"
(( hidden_size % heads == 0 )) || die "--hidden-size ($hidden_size) must be divisible by --num-attention-heads ($heads)"

world=$(( nnodes * gpus ))
(( world % (tp * pp) == 0 )) || die "world size $world (NNODES x GPUS_PER_NODE) is not divisible by tp x pp = $((tp * pp))"
dp=$(( world / (tp * pp) ))
global_batch="${global_batch:-$(( micro_batch * dp ))}"
is_posint "$global_batch" || die "--global-batch-size must be a positive integer, got '$global_batch'"
(( global_batch % (micro_batch * dp) == 0 )) \
    || die "--global-batch-size ($global_batch) must be a multiple of micro-batch-size x data-parallel size ($micro_batch x $dp)"

(( fp32_grad_accum + bf16_grad_reduce < 2 )) || die "--fp32-grad-accum and --bf16-grad-reduce exclude each other"

# The series is exercised only by this optimizer configuration; refuse passthrough that undoes it.
for a in "${extra[@]+"${extra[@]}"}"; do
    case "$a" in
        --grad-reduce-in-bf16) [[ $fp32_grad_accum == 0 ]] || die "--grad-reduce-in-bf16 contradicts --fp32-grad-accum" ;;
        --use-distributed-optimizer) die "--use-distributed-optimizer is forbidden with dist_muon (megatron: 'Muon optimizer does not support distributed optimizer')" ;;
        --optimizer|--optimizer=*) die "the optimizer is fixed to dist_muon by this script; do not pass $a" ;;
        --no-overlap-param-gather|--no-overlap-grad-reduce) die "$a would disable the path this script exercises" ;;
    esac
done

# ---------------------------------------------------------------- data and tokenizer
data_args=()
if [[ ${#data_paths[@]} -gt 0 ]]; then
    [[ $mock == 0 ]] || die "--mock-data and --data-path exclude each other"
    if [[ -z "$tokenizer_type" ]]; then
        if [[ -n "$tokenizer_model" ]]; then tokenizer_type=HuggingFaceTokenizer
        elif [[ -n "$vocab_file" && -n "$merge_file" ]]; then tokenizer_type=GPT2BPETokenizer
        else die "--data-path needs a tokenizer: --tokenizer-model PATH, or --vocab-file and --merge-file"
        fi
    fi
    read -r -a words <<< "${data_paths[*]}"   # "W1 P1 W2 P2" blends split into words, as megatron expects
    data_args+=(--data-path "${words[@]}" --split "$split")
else
    tokenizer_type="${tokenizer_type:-NullTokenizer}"
    data_args+=(--mock-data)
fi
data_args+=(--tokenizer-type "$tokenizer_type")
[[ "$tokenizer_type" != NullTokenizer ]] || data_args+=(--vocab-size "$vocab_size")
[[ -z "$tokenizer_model" ]] || data_args+=(--tokenizer-model "$tokenizer_model")
[[ -z "$vocab_file" ]] || data_args+=(--vocab-file "$vocab_file")
[[ -z "$merge_file" ]] || data_args+=(--merge-file "$merge_file")

# ---------------------------------------------------------------- the command
series_args=(--optimizer dist_muon --overlap-param-gather --overlap-grad-reduce --bf16)
[[ $fp32_grad_accum == 0 ]] || series_args+=(--accumulate-allreduce-grads-in-fp32)
[[ $bf16_grad_reduce == 0 ]] || series_args+=(--grad-reduce-in-bf16)

model_args=(
    --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp"
    --num-layers "$num_layers" --hidden-size "$hidden_size" --num-attention-heads "$heads"
    --seq-length "$seq_length" --max-position-embeddings "$seq_length"
    --micro-batch-size "$micro_batch" --global-batch-size "$global_batch"
    --train-iters "$train_iters" --lr "$lr" --min-lr 0.0 --lr-decay-style cosine
    --lr-warmup-iters 0 --weight-decay 0.1 --clip-grad 1.0 --seed "$seed"
    --log-interval 1 --eval-interval "$train_iters" --eval-iters 1
)
out_args=()
[[ -z "$save" ]] || out_args+=(--save "$save")
[[ -z "$load" ]] || out_args+=(--load "$load")
[[ -z "$tb_dir" ]] || out_args+=(--tensorboard-dir "$tb_dir" --log-timers-to-tensorboard)

env_args=(PYTHONPATH="$checkout${PYTHONPATH:+:$PYTHONPATH}" CUDA_DEVICE_MAX_CONNECTIONS=1)
cmd=(
    "$torchrun_bin" --nnodes "$nnodes" --node-rank "$node_rank" --nproc-per-node "$gpus"
    --master-addr "$master_addr" --master-port "$master_port"
    "$checkout/pretrain_gpt.py"
    "${series_args[@]}" "${model_args[@]}" "${data_args[@]}"
    "${out_args[@]+"${out_args[@]}"}" "${extra[@]+"${extra[@]}"}"
)

if [[ $dry_run == 1 ]]; then
    # One line, each word shell-quoted: paste it into a shell, or eval it.
    printf 'env'; printf ' %q' "${env_args[@]}" "${cmd[@]}"; printf '\n'
    exit 0
fi
command -v "$torchrun_bin" >/dev/null 2>&1 || die "'$torchrun_bin' not found: run inside the NGC container or set TORCHRUN"
echo "$PROG: node $node_rank/$nnodes, $gpus GPU(s) per node, dp=$dp tp=$tp pp=$pp, checkout $checkout" >&2
exec env "${env_args[@]}" "${cmd[@]}"
