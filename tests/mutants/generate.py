"""Write every mutant of tests/mutants/ from the patched trees (the series of each base).

Usage: .venv/bin/python tests/mutants/generate.py [NAME ...]   (default: every mutant)

A mutant is one deliberate bug on top of the series: a description, then a unified diff
against the patched tree (megatron/ for 0.17.1, build/patched-0.19/megatron for 0.19,
written by scripts/setup.sh), made here by exact text replacement (each old text must occur
once). Rerun after a change of the series; tests/unit_tests/test_layerwise_param_sync.py
and test_grad_data_guards.py list which checks each mutant must fail.

Raises:
    AssertionError: an old text does not occur exactly once in a patched file.
"""
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE_TREES = {"0.17.1": ROOT, "0.19": ROOT / "build" / "patched-0.19"}
OUT = {base: ROOT / "tests" / "mutants" / base for base in BASE_TREES}
PGB = "megatron/core/distributed/param_and_grad_buffer.py"
DDP = "megatron/core/distributed/distributed_data_parallel.py"
LWO = "megatron/core/optimizer/layer_wise_optimizer.py"
ZERO = ("            if bucket.layerwise_gather_in_grad_data:\n"
        "                torch._foreach_zero_(bucket.layerwise_gather_list)\n")

MUTANTS = {
    "no_zeroing": (
        "The copy-out does not zero the slots it received into (upstream PR #3751 as first\n"
        "shipped): backward then accumulates the gradients onto the gathered param bytes.",
        PGB, [(ZERO, "")]),
    "zeroes_all_of_grad_data": (
        "The copy-out zeroes the whole of grad_data, not only the slots the gather wrote (as\n"
        "pristine 0.19.2 does): a sync that received into a temporary, or over grads, wipes them.",
        PGB, [(ZERO, ZERO + "            bucket.grad_data.zero_()\n")]),
    "zeroing_only_in_pre_hooks": (
        "The copy-out zeroes the slots only when a forward pre-hook finishes the gather\n"
        "(finish_param_sync), not when a forced sync or free_overlap_buffers() completes it.",
        PGB, [(ZERO, "            import sys\n\n"
                     "            if bucket.layerwise_gather_in_grad_data and (\n"
                     "                sys._getframe(1).f_code.co_name == \"finish_param_sync\"\n"
                     "            ):\n"
                     "                torch._foreach_zero_(bucket.layerwise_gather_list)\n")]),
    "copy_back_skips_rank1": (
        "The copy-out skips DP rank 1's slot: the other ranks keep stale values of what rank 1\n"
        "updated.",
        PGB, [("                if len(params) == 0 or idx == local_rank:\n",
               "                if len(params) == 0 or idx == local_rank or idx == 1:\n")]),
    "broadcast_from_wrong_owner": (
        "The pre-hook path's broadcasts are rooted at the next rank, not at the slot's owner.",
        PGB, [("                src = torch.distributed.get_global_rank(group, r)\n",
               "                src = torch.distributed.get_global_rank(group, (r + 1) % len(slots))\n")]),
    "skipped_nonempty_share": (
        "The pre-hook path skips the broadcast of the last rank that owns a param of the bucket.",
        PGB, [("            if slot.numel() > 0:\n",
               "            if slot.numel() > 0 and r != max(i for i, s in enumerate(slots) if s.numel()):\n")]),
    "slots_out_of_rank_order": (
        "The receive slots are laid out in reverse rank order (the last rank's slot at element\n"
        "0), not packed in rank order: all_gather_into_tensor's chunks no longer are the slots.",
        PGB, [("                gather_list = list(recv.split(bucket.layerwise_param_flat_sizes))\n",
               "                gather_list = list(recv.split(bucket.layerwise_param_flat_sizes[::-1]))[::-1]\n")]),
    "gather_over_grads": (
        "The pre-hook path receives into grad_data whatever grad_data_idle says: a sync over\n"
        "grads that no zero_grad_buffer() reset overwrites them, and its copy-out zeroes them.",
        PGB, [("                    self.grad_data_idle\n                    and not force_sync\n",
               "                    not force_sync\n")]),
    "forced_sync_into_grad_data": (
        "A forced sync (evaluation, checkpoint) receives into idle grad_data too, where a grad\n"
        "may be (pristine 0.19.2's bug class): the copy-out zeroes what it wrote there.",
        PGB, [("                    self.grad_data_idle\n                    and not force_sync\n",
               "                    self.grad_data_idle\n")]),
    "zero_grad_buffer_under_pending_gather": (
        "zero_grad_buffer() zeroes grad_data under a pending layer-wise gather instead\n"
        "of completing it first.",
        DDP, [("        self.finish_layerwise_param_gathers()\n        for buffer in self.buffers + self.expert_parallel_buffers:\n            buffer.reset()\n",
               "        for buffer in self.buffers + self.expert_parallel_buffers:\n            buffer.reset()\n")]),
    "optimizer_broadcast_from_wrong_owner": (
        "The optimizer path's in-place broadcasts (allgather_params(), no\n"
        "--overlap-param-gather) are rooted at the next rank, not at the param's owner.",
        LWO, [("                        src = torch.distributed.get_global_rank(group, r)\n",
               "                        src = torch.distributed.get_global_rank(group, (r + 1) % len(params_list))\n")]),
}

# Rules of patches 0001 (the step re-arms) and 0004 (grad_data only while idle), in guards/: caught by
# tests/unit_tests/test_grad_data_guards.py.
MUTANTS.update({
    "guards/backward_hook_leaves_grad_data_idle": (
        "DDP's backward hook does not clear grad_data_idle: a gather started after backward,\n"
        "before the grad reduce, receives over the grads.",
        DDP, [("                bucket_group.grad_data_idle = False\n", "")]),
    "guards/start_grad_sync_leaves_grad_data_idle": (
        "start_grad_sync() does not clear grad_data_idle: after a backward without DDP's\n"
        "hooks, a gather between the grad reduce and the step receives over the reduced grads.",
        PGB, [("        self.grad_data_idle = False\n        if self.is_first_batch",
               "        if self.is_first_batch")]),
    "guards/start_grad_sync_leaves_gather_pending": (
        "start_grad_sync() does not complete a pending layer-wise gather: the grad reduce of a\n"
        "bucket group that got no grads reads what the gather writes into its grad_data.",
        PGB, [("        self.finish_layerwise_param_gather()\n        self.grad_data_idle = False\n",
               "        self.grad_data_idle = False\n")]),
    "guards/backward_hook_does_not_raise": (
        "DDP's backward hook lets a grad land while its bucket group's gather into grad_data\n"
        "is in flight (the RuntimeError dropped).",
        DDP, [("                if any(bucket.layerwise_gather_in_grad_data for bucket in",
               "                if False and any(bucket.layerwise_gather_in_grad_data for bucket in")]),
    "guards/step_keeps_dispatch_mark": (
        "The optimizer step does not clear param_gather_dispatched: after a forced sync between\n"
        "finish_grad_sync() and the step, the next forward computes with the other ranks'\n"
        "params of before the step.",
        LWO, [("model_chunk.reset_param_sync_dispatch_state()\n", "pass\n")]),
    "guards/completion_keyed_on_overlap_grad_reduce": (
        "zero_grad_buffer() and offload_grad_buffers() complete pending layer-wise gathers only\n"
        "with --overlap-grad-reduce (the wrong flag): with --overlap-param-gather alone, a gather\n"
        "started in the idle window is zeroed under its landed data.",
        DDP, [("        if self.ddp_config.overlap_param_gather and not self.ddp_config.use_distributed_optimizer:\n"
               "            for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:\n"
               "                bucket_group.finish_layerwise_param_gather()\n",
               "        if self.ddp_config.overlap_grad_reduce and not self.ddp_config.use_distributed_optimizer:\n"
               "            for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:\n"
               "                bucket_group.finish_layerwise_param_gather()\n")]),
    "guards/step_leaves_gather_pending": (
        "The optimizer step does not complete a pending gather before it clears the dispatch\n"
        "mark: the next forward's pre-hook starts another gather over it (0.17.1's assertion).",
        LWO, [("model_chunk.finish_layerwise_param_gathers()\n", "pass\n")]),
})

# The same rules applied to the dense bucket groups only, or to one call site less (a review
# planted each of these in series v6 and the earlier tests missed them), in guards/.
MUTANTS.update({
    "guards/completion_on_dense_groups_only": (
        "zero_grad_buffer(), offload_grad_buffers() and the step complete pending gathers of the\n"
        "dense bucket groups only: an expert group's gather into idle grad_data is zeroed under it.",
        DDP, [("            for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:\n"
               "                bucket_group.finish_layerwise_param_gather()\n",
               "            for bucket_group in self.bucket_groups:\n"
               "                bucket_group.finish_layerwise_param_gather()\n")]),
    "guards/offload_clears_idle_on_dense_groups_only": (
        "offload_grad_buffers() clears grad_data_idle of the dense bucket groups only: a gather\n"
        "after offload receives into an expert group's freed grad_data.",
        DDP, [("        for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:\n"
               "            bucket_group.grad_data_idle = False",
               "        for bucket_group in self.bucket_groups:\n"
               "            bucket_group.grad_data_idle = False")]),
    "guards/offload_leaves_grad_data_idle": (
        "offload_grad_buffers() leaves grad_data_idle set: zero_grad_buffer(), offload, then a\n"
        "non-forced gather receives into the freed storage.",
        DDP, [("        for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:\n"
               "            bucket_group.grad_data_idle = False  # no layer-wise gather into freed grad_data\n",
               "")]),
    "guards/backward_hook_clears_idle_only_where_it_adds": (
        "DDP's backward hook clears grad_data_idle only where it adds the grad itself: with\n"
        "fused wgrad the grad is already in main_grad, and a later gather receives over it.",
        DDP, [("                bucket_group.grad_data_idle = False\n",
               "                bucket_group.grad_data_idle &= param.grad_added_to_main_grad\n")]),
    "guards/optimizer_gather_skips_expert_params": (
        "The optimizer's gather (no --overlap-param-gather) leaves out the expert-DP group: the\n"
        "expert params differ across expert-DP ranks after every step.",
        LWO, [("        if self.expt_dp_params_list:\n            _allgather_helper(",
               "        if False and self.expt_dp_params_list:\n            _allgather_helper(")]),
})

# Patch 0002 reverted, in handles/: caught by tests/unit_tests/test_layerwise_param_sync.py.
MUTANTS.update({
    "handles/wait_on_last_handle_only": (
        "patch 0002 reverted: a bucket group's handle waits on its last work only (as pristine).",
        PGB, [("        for handle in self.handles or []:\n            handle.wait()\n",
               "        if self.handles:\n            self.handles[-1].wait()\n")]),
})

# The real-shape audit's teeth (tests/unit_tests/test_audit.py), in audit/.
MUTANTS.update({
    "audit/grad_data_never_idle": (
        "The pre-hook path never receives into grad_data, as if it were never idle: every\n"
        "gather takes a temporary of its bucket's size, as 0.17.1 did.",
        PGB, [("                    self.grad_data_idle\n                    and not force_sync\n",
               "                    False\n                    and not force_sync\n")]),
})


def main(names):
    for base, tree in BASE_TREES.items():
        for name in names or MUTANTS:
            desc, rel, reps = MUTANTS[name]
            old = (tree / rel).read_text()
            new = old
            for a, b in reps:
                assert new.count(a) == 1, (base, name, a, new.count(a))
                new = new.replace(a, b)
            with tempfile.TemporaryDirectory() as tmp:
                fa, fb = Path(tmp) / "a", Path(tmp) / "b"
                fa.write_text(old)
                fb.write_text(new)
                diff = subprocess.run(["diff", "-u", "--label", f"a/{rel}", "--label", f"b/{rel}", str(fa), str(fb)],
                                      capture_output=True, text=True).stdout
            assert diff
            out = OUT[base] / f"{name}.patch"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(f"Mutant: {desc}\n\n{diff}")
            print(base, name, "written")


if __name__ == "__main__":
    main(sys.argv[1:])
