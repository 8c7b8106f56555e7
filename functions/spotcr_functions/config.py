"""Function settings: read once from the environment at the handler's edge, typed from then on.

The model, each setting's variable, default and description, is spotcr_contracts.settings: infra/ and the local
AWS stand-ins render the same one.
"""

from spotcr_contracts.settings import ENV, InvalidSettings, env_name
from spotcr_contracts.settings import FunctionSettings as Settings

__all__ = ["ENV", "InvalidSettings", "Settings", "env_name"]
