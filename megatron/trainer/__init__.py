"""The MegatronDPP trainer on megatron.core."""

import warnings

# megatron.core warns at every import that the optional Apex / Transformer Engine kernels are
# absent; the trainer reports which accelerators it uses once, in its start-up log.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*", category=UserWarning)
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)
