#!/usr/bin/env bash
# scripts/launch_pretrain_gpt.sh: torchrun upstream's pretrain_gpt.py on a Megatron-LM checkout
# that carries the series (scripts/apply_patches.sh), with the flags that exercise it.
#
# Usage: scripts/launch_pretrain_gpt.sh [--dry-run] [--allow-unpatched] [--no-overlap-param-gather]
#                                     [MEGATRON_LM_DIR] [MEGATRON FLAGS...]
#
#   MEGATRON_LM_DIR     the checkout (holds pretrain_gpt.py), as the first argument; else $MEGATRON_LM
#   MEGATRON FLAGS      pretrain_gpt.py's own flags, passed through unchanged and in order
#                       (--tensor-model-parallel-size 2, --accumulate-allreduce-grads-in-fp32,
#                       --data-path 0.3 /d/a 0.7 /d/b, --flag=value, ...). A leading '--' is optional.
#   --dry-run           print the command as one shell-quoted line (torchrun ... pretrain_gpt.py ...)
#                       that can be pasted into a shell; run nothing
#   --allow-unpatched   launch even if scripts/apply_patches.sh --check does not say "applied"
#                       (an upstream baseline); by default that is an error
#   --no-overlap-param-gather
#                       do not add --overlap-param-gather: the params are then gathered by the
#                       optimizer at the end of step() (the series' patch 0006 path)
#   -h, --help
#
# Added only where the flags do not give them (the same names, so the flags always win):
#   the series' path:  --optimizer dist_muon --overlap-param-gather --overlap-grad-reduce --bf16
#                      (dist_muon is the layer-wise optimizer; --overlap-param-gather needs
#                      --overlap-grad-reduce; --no-overlap-param-gather leaves it out)
#   a small GPT:       --num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024
#                      --max-position-embeddings <seq-length> --micro-batch-size 2
#                      --global-batch-size <micro-batch-size x data-parallel size> --train-iters 100
#                      --lr 3e-4 --min-lr 0.0 --lr-decay-style cosine --lr-warmup-iters 0
#                      --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --log-interval 1
#                      --eval-interval <train-iters> --eval-iters 1
#   data:              no --data-path: --mock-data --tokenizer-type NullTokenizer --vocab-size 32768;
#                      --data-path with --tokenizer-model: --tokenizer-type HuggingFaceTokenizer;
#                      with --vocab-file and --merge-file: --tokenizer-type GPT2BPETokenizer
# Refused (megatron's rules for this path): --optimizer other than dist_muon,
# --use-distributed-optimizer (Muon forbids it), --fp16 (megatron/core/optimizer/muon.py raises
# 'muon with fp16 is not supported.' when the optimizer is built, after start-up), and on a
# megatron-core 0.19 checkout --use-cpu-initialization without --use-torch-fsdp2 (0.19's model
# builder then leaves the model on the CPU and the bf16 optimizer raises TypeError).
# Warned about: a data-parallel size of 1 (world / (tp x pp x cp)): the layer-wise optimizer then
# gathers nothing (patch 0003) and none of the series' param-sync code runs. Not Megatron flags, refused with the upstream
# name: --tp, --pp, --fp32-grad-accum, --bf16-grad-reduce.
#
# Environment (as torchrun/Slurm/Kubernetes launchers set them; defaults are one node):
#   NNODES (else SLURM_NNODES, else 1)      NODE_RANK (else SLURM_NODEID, else 0)
#   MASTER_ADDR (one node: localhost; several under Slurm: the first host of
#     `scontrol show hostnames "$SLURM_JOB_NODELIST"`; several otherwise: an error)
#   MASTER_PORT (6000)
#   GPUS_PER_NODE (else the entries of CUDA_VISIBLE_DEVICES, else SLURM_GPUS_ON_NODE, else the
#     `nvidia-smi -L` count, else 1)
#   TORCHRUN (torchrun)                     MEGATRON_LM (checkout, if not given as argument)
#   CUDA_DEVICE_MAX_CONNECTIONS: set to 1 when tensor or context parallel size > 1 and it is
#   unset (megatron's validate_args asserts it before Blackwell); the printed line then starts
#   with that assignment.
#
# Before launching (also with --dry-run) the checkout is checked with scripts/apply_patches.sh --check.
#
# Exit: 0 ran (or printed, with --dry-run); 2 bad usage or input, or the series is not applied;
#       otherwise torchrun's exit code.
set -euo pipefail

PROG="launch_pretrain_gpt.sh"
die() { echo "$PROG: error: $*" >&2; exit 2; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
is_posint() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }
is_nonneg() { [[ "$1" =~ ^(0|[1-9][0-9]*)$ ]]; }

# ---------------------------------------------------------------- arguments
checkout="" dry_run=0 allow_unpatched=0 overlap_param_gather=1
flags=()            # megatron flags, verbatim
declare -A given    # flag name -> its (last) value; "" for a bare flag
last=""             # the flag that the next word may be a value of
for a in "$@"; do
    case "$a" in
        -h|--help) usage; exit 0 ;;
        --dry-run) dry_run=1; last=""; continue ;;
        --allow-unpatched) allow_unpatched=1; last=""; continue ;;
        --no-overlap-param-gather) overlap_param_gather=0; last=""; continue ;;
        --) last=""; continue ;;   # optional separator before the megatron flags
        --tp|--tp=*) die "--tp is not a Megatron flag: use --tensor-model-parallel-size N" ;;
        --pp|--pp=*) die "--pp is not a Megatron flag: use --pipeline-model-parallel-size N" ;;
        --fp32-grad-accum) die "--fp32-grad-accum is not a Megatron flag: use --accumulate-allreduce-grads-in-fp32" ;;
        --bf16-grad-reduce) die "--bf16-grad-reduce is not a Megatron flag: use --grad-reduce-in-bf16" ;;
        --*=*) name="${a%%=*}"; given["$name"]="${a#*=}"; flags+=("$a"); last="" ;;
        --*) given["$a"]=""; flags+=("$a"); last="$a" ;;
        *)  if [[ ${#flags[@]} -eq 0 && -z "$checkout" ]]; then
                checkout="$a"
            elif [[ -n "$last" ]]; then
                # A value (or one more word of a list value, e.g. --data-path W1 P1 W2 P2).
                if [[ -z "${given[$last]}" ]]; then given["$last"]="$a"; else given["$last"]+=" $a"; fi
                flags+=("$a")
            else
                die "'$a' is not a flag nor the value of one (the checkout goes first; see --help)"
            fi ;;
    esac
done
has() { [[ -v "given[$1]" ]]; }
val() { if has "$1"; then echo "${given[$1]}"; else echo "$2"; fi; }

# ---------------------------------------------------------------- checkout
checkout="${checkout:-${MEGATRON_LM:-}}"
[[ -n "$checkout" ]] || die "no Megatron-LM checkout: pass its path first or set MEGATRON_LM"
[[ -d "$checkout" ]] || die "Megatron-LM checkout '$checkout' does not exist"
[[ -f "$checkout/pretrain_gpt.py" ]] \
    || die "'$checkout' has no pretrain_gpt.py: pass the root of a Megatron-LM checkout (git clone --branch core_v0.17.1)"
[[ -d "$checkout/megatron/core" ]] || die "'$checkout' has no megatron/core: not a Megatron-LM checkout"
checkout="$(cd "$checkout" && pwd)"

# Is the series in? apply_patches.sh --check: 0 applied, otherwise not (see its header).
apply="$(dirname "${BASH_SOURCE[0]}")/apply_patches.sh"
series_rc=0
series_msg="$(bash "$apply" "$checkout" --check 2>&1)" || series_rc=$?
if [[ $series_rc != 0 ]]; then
    [[ $allow_unpatched == 1 ]] \
        || die "the series is not applied to '$checkout' (apply_patches.sh --check exit $series_rc: ${series_msg//$'\n'/ }); run scripts/apply_patches.sh '$checkout', or pass --allow-unpatched for an upstream baseline"
    echo "$PROG: warning: ${series_msg//$'\n'/ } (--allow-unpatched: launching anyway)" >&2
fi

# ---------------------------------------------------------------- launcher environment
nnodes="${NNODES:-${SLURM_NNODES:-1}}"
node_rank="${NODE_RANK:-${SLURM_NODEID:-0}}"
is_posint "$nnodes" || die "NNODES must be a positive integer, got '$nnodes'"
is_nonneg "$node_rank" || die "NODE_RANK must be a non-negative integer, got '$node_rank'"
(( node_rank < nnodes )) || die "NODE_RANK ($node_rank) must be less than NNODES ($nnodes)"
master_port="${MASTER_PORT:-6000}"
if [[ -n "${MASTER_ADDR:-}" ]]; then master_addr="$MASTER_ADDR"
elif (( nnodes == 1 )); then master_addr=localhost
elif [[ -n "${SLURM_JOB_NODELIST:-}${SLURM_NODELIST:-}" ]]; then
    # Every node must rendezvous at the same host: Slurm's first node of the job.
    command -v scontrol >/dev/null 2>&1 \
        || die "NNODES=$nnodes under Slurm without MASTER_ADDR, and no scontrol to find the head node: export MASTER_ADDR=\$(scontrol show hostnames \"\$SLURM_JOB_NODELIST\" | head -n1) in the batch script"
    master_addr="$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$SLURM_NODELIST}" 2>/dev/null | head -n1)" || true
    [[ -n "$master_addr" ]] \
        || die "NNODES=$nnodes: 'scontrol show hostnames ${SLURM_JOB_NODELIST:-$SLURM_NODELIST}' gave no host; set MASTER_ADDR to the first node"
else
    die "NNODES=$nnodes and no MASTER_ADDR: set MASTER_ADDR to a host every node can reach (node 0), the same on every node"
fi
if [[ -n "${GPUS_PER_NODE:-}" ]]; then gpus="$GPUS_PER_NODE"
elif [[ -v CUDA_VISIBLE_DEVICES ]]; then
    IFS=, read -r -a visible <<< "$CUDA_VISIBLE_DEVICES"
    gpus="${#visible[@]}"
    (( gpus > 0 )) || die "CUDA_VISIBLE_DEVICES is empty: no GPU is visible; unset it or list the GPUs (CUDA_VISIBLE_DEVICES=0,1)"
elif [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then gpus="$SLURM_GPUS_ON_NODE"
elif command -v nvidia-smi >/dev/null 2>&1 && n="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" && [[ "$n" -gt 0 ]]; then gpus="$n"
else gpus=1
fi
torchrun_bin="${TORCHRUN:-torchrun}"

is_posint "$gpus" || die "GPUS_PER_NODE must be a positive integer, got '$gpus'"
[[ "$master_port" =~ ^[0-9]+$ ]] && (( master_port > 0 && master_port < 65536 )) \
    || die "MASTER_PORT must be a port number (1-65535), got '$master_port'"
[[ -n "$master_addr" && "$master_addr" != *[[:space:]]* ]] || die "MASTER_ADDR must be a host name or address, got '$master_addr'"

# ---------------------------------------------------------------- the flags this script reads
optimizer="$(val --optimizer dist_muon)"
[[ "$optimizer" == dist_muon ]] || die "--optimizer $optimizer: this script runs the layer-wise optimizer, --optimizer dist_muon"
! has --fp16 || die "--fp16 is refused: Muon does not support fp16 (megatron/core/optimizer/muon.py: 'muon with fp16 is not supported.', raised when the optimizer is built); use --bf16"
! has --use-distributed-optimizer || die "--use-distributed-optimizer is forbidden with dist_muon (megatron: 'Muon optimizer does not support distributed optimizer')"
# megatron-core >= 0.19 builds the model in megatron/training/models/dist_utils.py
# (prepare_existing_model_chunks_for_distributed_training), which moves it to the GPU only
# without --use-cpu-initialization; 0.17.1's get_model moves it either way.
mcore_version="$(sed -nE 's/^(MAJOR|MINOR)[[:space:]]*=[[:space:]]*([0-9]+).*/\2/p' "$checkout/megatron/core/package_info.py" 2>/dev/null | head -n2 | paste -sd.)"
if has --use-cpu-initialization && ! has --use-torch-fsdp2 && [[ "$mcore_version" =~ ^([0-9]+)\.([0-9]+)$ ]] \
    && (( BASH_REMATCH[1] > 0 || BASH_REMATCH[2] >= 19 )); then
    die "--use-cpu-initialization on GPUs with megatron-core $mcore_version: its model builder (megatron/training/models/dist_utils.py) then leaves the model on the CPU, and the bf16 optimizer raises TypeError ('Wrapped parameters must be one of torch.cuda.FloatTensor ...'); drop --use-cpu-initialization (the weights are then initialized on the GPU)"
fi
for f in --tensor-model-parallel-size --pipeline-model-parallel-size --context-parallel-size \
         --micro-batch-size --train-iters --seq-length; do
    ! has "$f" || is_posint "${given[$f]}" || die "$f must be a positive integer, got '${given[$f]}'"
done
tp="$(val --tensor-model-parallel-size 1)" pp="$(val --pipeline-model-parallel-size 1)"
cp="$(val --context-parallel-size 1)"
micro_batch="$(val --micro-batch-size 2)" train_iters="$(val --train-iters 100)"
seq_length="$(val --seq-length 1024)"
world=$(( nnodes * gpus ))
(( world % (tp * pp * cp) == 0 )) \
    || die "world size $world (NNODES x GPUS_PER_NODE) is not divisible by tensor x pipeline x context parallel size = $((tp * pp * cp))"
dp=$(( world / (tp * pp * cp) ))
if has --global-batch-size; then
    global_batch="${given[--global-batch-size]}"
    is_posint "$global_batch" || die "--global-batch-size must be a positive integer, got '$global_batch'"
    (( global_batch % (micro_batch * dp) == 0 )) \
        || die "--global-batch-size ($global_batch) must be a multiple of micro-batch-size x data-parallel size ($micro_batch x $dp)"
else
    global_batch=$(( micro_batch * dp ))
fi

# ---------------------------------------------------------------- defaults for what is not given
defaults=()
add() { has "$1" || defaults+=("$@"); }   # add FLAG [VALUE...] unless FLAG was given
add --optimizer dist_muon
if [[ $overlap_param_gather == 1 ]]; then add --overlap-param-gather
else ! has --overlap-param-gather || die "--no-overlap-param-gather and --overlap-param-gather exclude each other"
fi
add --overlap-grad-reduce
add --bf16
add --num-layers 4
add --hidden-size 512
add --num-attention-heads 8
add --seq-length "$seq_length"
add --max-position-embeddings "$seq_length"
add --micro-batch-size "$micro_batch"
add --global-batch-size "$global_batch"
add --train-iters "$train_iters"
add --lr 3e-4
add --min-lr 0.0
add --lr-decay-style cosine
add --lr-warmup-iters 0
add --weight-decay 0.1
add --clip-grad 1.0
add --seed 1234
add --log-interval 1
add --eval-interval "$train_iters"
add --eval-iters 1
if has --data-path; then
    ! has --mock-data || die "--mock-data and --data-path exclude each other"
    if ! has --tokenizer-type; then
        if has --tokenizer-model; then defaults+=(--tokenizer-type HuggingFaceTokenizer)
        elif has --vocab-file && has --merge-file; then defaults+=(--tokenizer-type GPT2BPETokenizer)
        else die "--data-path needs a tokenizer: --tokenizer-model PATH, or --vocab-file and --merge-file"
        fi
    fi
elif ! has --mock-data && ! has --train-data-path; then
    defaults+=(--mock-data)
    add --tokenizer-type NullTokenizer
    [[ "$(val --tokenizer-type NullTokenizer)" != NullTokenizer ]] || add --vocab-size 32768
fi

(( dp > 1 )) || echo "$PROG: warning: data-parallel size 1 (world $world / tp $tp x pp $pp x cp $cp): the layer-wise optimizer gathers nothing at DP 1 (patch 0003), so none of the series' param-sync code runs; use 2 or more data-parallel ranks to exercise it" >&2

# ---------------------------------------------------------------- the command
env_words=()
if (( tp > 1 || cp > 1 )) && [[ -z "${CUDA_DEVICE_MAX_CONNECTIONS:-}" ]]; then
    env_words=(CUDA_DEVICE_MAX_CONNECTIONS=1)
fi
cmd=(
    "$torchrun_bin" --nnodes "$nnodes" --node-rank "$node_rank" --nproc-per-node "$gpus"
    --master-addr "$master_addr" --master-port "$master_port"
    "$checkout/pretrain_gpt.py"
    "${defaults[@]+"${defaults[@]}"}" "${flags[@]+"${flags[@]}"}"
)

if [[ $dry_run == 1 ]]; then
    # One line, each word shell-quoted: paste it into a shell.
    words=("${env_words[@]+"${env_words[@]}"}" "${cmd[@]}")
    printf '%q' "${words[0]}"; printf ' %q' "${words[@]:1}"; printf '\n'
    exit 0
fi
command -v "$torchrun_bin" >/dev/null 2>&1 || die "'$torchrun_bin' not found: run inside the NGC container or set TORCHRUN"
echo "$PROG: node $node_rank/$nnodes, $gpus GPU(s) per node, dp=$dp tp=$tp pp=$pp cp=$cp, checkout $checkout" >&2
[[ ${#env_words[@]} -eq 0 ]] || export "${env_words[@]}"
exec "${cmd[@]}"
