"""jaxmp.optim on 8 forced CPU devices (FSDP): sharded_checks.py in a subprocess."""

import pathlib

from tests import eight_devices

SCRIPT = pathlib.Path(__file__).with_name("sharded_checks.py")
CHECKS = ("optimizer_parity", "clipped_parity", "quantized_parity", "fsdp_train_step")

eight_device_results, test_eight_devices, test_the_check_names_match_the_script = (
    eight_devices.make_tests(SCRIPT, CHECKS, cwd=SCRIPT.parents[2]))
