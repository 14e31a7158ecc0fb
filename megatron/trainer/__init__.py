"""The MegatronDPP trainer on megatron.core."""

import warnings

# megatron.core warns at every import that the optional Apex / Transformer Engine kernels are
# absent; the trainer reports which accelerators it uses once, in its start-up log.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*", category=UserWarning)
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)
# megatron.core 0.19 at import: a model the trainer does not use is experimental
warnings.filterwarnings("ignore", message=r"MimoModelConfig is experimental", category=UserWarning)
# torch at each barrier of a NCCL job without an eager device: it uses the current device,
# which the trainer sets before any barrier
warnings.filterwarnings("ignore", message=r"barrier\(\): using the device under current context",
                        category=UserWarning)
# torch at every checkpoint load through megatron.core's dist_checkpointing, which still
# calls the deprecated names; nothing a user of this trainer can change
warnings.filterwarnings("ignore", message=r"`load_state_dict` is deprecated", category=FutureWarning)
warnings.filterwarnings("ignore", message=r"Please use DTensor instead and we are deprecating "
                        r"ShardedTensor", category=FutureWarning)
