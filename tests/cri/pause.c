/* The sandbox ("pause") process of the test pods: PID 1 of the sandbox, holding its
 * namespaces open. It waits for SIGTERM or SIGINT (how containerd stops a sandbox), reaps
 * any child that gets reparented to it, and exits 0. Built with `gcc -static` at test time,
 * since no registry with the real pause image is reachable. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t stopping;

static void on_stop(int sig) { (void)sig; stopping = 1; }

static void on_child(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction stop = {.sa_handler = on_stop};
    struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
    sigemptyset(&stop.sa_mask);
    sigemptyset(&child.sa_mask);
    if (sigaction(SIGTERM, &stop, NULL) || sigaction(SIGINT, &stop, NULL) ||
        sigaction(SIGCHLD, &child, NULL))
        return 1;
    while (!stopping)
        pause();
    return 0;
}
