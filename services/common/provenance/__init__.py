"""What a run proves: the signed run record (R42), verification results, test counts and
compiled files a reviewer cannot read."""
