# pbox under a real Slurm (tests/slurm): munged, slurmctld and slurmd started by the test with a
# generated config in a temp dir; an sbatch job runs deploy/slurm/pbox-slurm and the Python
# cluster client. Skips with the reason when slurm-wlm/munge (scripts/deps/slurm.txt) are missing.
# Label `slurm` (ctest -L slurm / -LE slurm).

find_program(PBOX_SLURM_PYTHON3 python3 PATHS /usr/bin NO_DEFAULT_PATH REQUIRED)

add_test(NAME pbox_slurm
         COMMAND ${PBOX_SLURM_PYTHON3} -m pytest -q -x -s -p no:cacheprovider
                 ${PROJECT_SOURCE_DIR}/tests/slurm)
set_tests_properties(pbox_slurm PROPERTIES
  ENVIRONMENT "PYTHONPATH=${CMAKE_BINARY_DIR}/python;PBOXD=$<TARGET_FILE:pboxd>"
  LABELS "slurm;root"
  TIMEOUT 420)
