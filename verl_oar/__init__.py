"""verl-oar: Outcome-grounded Advantage Reshaping for verl.

The math (``reshape``, ``outcome``, ``importance``) imports no verl; the verl-facing layer
(``plugin``, ``estimators``, ``worker``, ``trainer``, ``cpu``) is thin and names the verl
extension point it uses at the top of each file.
"""

__version__ = "0.1.0"
