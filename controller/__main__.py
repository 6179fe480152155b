"""`python -m controller` is `ctl` (one module instance, so command groups register on one app)."""

from controller.launch.main import main

main()
