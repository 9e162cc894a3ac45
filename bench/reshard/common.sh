# Helpers shared by the reshard benchmark scripts (sourced, not run).

# Drops the page cache of every file under the given directories (posix_fadvise DONTNEED), so
# that the next read comes from the disk.
evict() {
  /usr/bin/python3 -c 'import os,sys
for root in sys.argv[1:]:
    for dp, _, fs in os.walk(root):
        for f in fs:
            fd = os.open(os.path.join(dp, f), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)' "$@"
}

# The median of the numbers on stdin, one per line, with two decimals.
median() { sort -n | awk '{v[NR]=$1} END{printf "%.2f", NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
