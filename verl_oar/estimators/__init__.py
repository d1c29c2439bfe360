"""verl advantage estimators of verl-oar, one file each; importing this package registers them."""

from verl_oar.estimators import oar_g  # noqa: F401
from verl_oar.estimators import oar_p  # noqa: F401
