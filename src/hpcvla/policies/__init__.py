"""Policies: the `Policy` interface, the default small policy, the VLA families (flow
matching, action tokens, the published OpenVLA-OFT), and a by-name factory (registry.py)."""

from __future__ import annotations

from hpcvla.policies.base import ActOutput, Policy
from hpcvla.policies.default import DefaultPolicy
from hpcvla.policies.flow import FlowPolicy
from hpcvla.policies.folders import save_pretrained
from hpcvla.policies.oft import OFTPolicy
from hpcvla.policies.registry import POLICIES, load_pretrained, make_policy, policy_kwargs
from hpcvla.policies.tokens import ActionTokenPolicy

__all__ = ["ActOutput", "Policy", "DefaultPolicy", "FlowPolicy", "ActionTokenPolicy", "OFTPolicy",
           "POLICIES",
           "make_policy", "policy_kwargs", "save_pretrained",
           "load_pretrained"]
