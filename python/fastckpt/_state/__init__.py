"""Layer 3, what a training state is: the pieces a checkpoint holds, each to and from tensors + JSON.

model (state_dict, tied-weight aliases, model load plans, config.json), live targets (reading straight into live
tensors), optimizer (state keyed by parameter fqn, ``param_groups``), scheduler classes, destination checks (layouts a
load cannot write), RNG states, other objects' state_dicts.

May import: layers 0-2 (``_core``, ``errors``, ``_version``, ``_format``, ``_io``) and other ``_state`` modules.
"""
