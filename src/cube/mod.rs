mod fusion;
