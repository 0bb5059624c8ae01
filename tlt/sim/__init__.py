"""Cluster-scale simulation of the rollout's tail (``tlt bench cluster``): pure Python, no torch.

    rollout     one rollout over N replicas from measured step costs (events, moves, early stop)
    systems     plain, TLT, RLHFSpec, RLHFuse, cost-model consolidation, RollPacker, PAT
    workloads   cluster scales, response-length profiles, step-cost curves from bench records
"""
